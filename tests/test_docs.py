"""The docs as reference (STYLE.md item 9): every relative link and #anchor in README.md and
docs/*.md resolves; the README's figures are the numbers in their results files, to the
precision printed; every file under benchmarks/results/ is named by a doc, a test or a
benchmark; dated headings (the history of runs) live in docs/history.md alone."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = (ROOT / "README.md").read_text()

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped (but - and _),
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"^#{1,6} (.+)$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", page.read_text())) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_dated_headings_live_in_the_history_page_alone():
    dated = [
        f"{page.name}: {line}"
        for page in PAGES
        if page.name != "history.md"
        for line in FENCE.sub("", page.read_text()).splitlines()
        if re.match(r"^#.*20\d\d-", line)
    ]
    assert not dated


def test_the_history_page_runs_oldest_first():
    dates = re.findall(r"^## (20\d\d-\d\d-\d\d)", (ROOT / "docs" / "history.md").read_text(), re.M)
    assert dates and dates == sorted(dates)


def test_every_results_file_is_named_by_a_doc_a_test_or_a_benchmark():
    texts = [p.read_text() for p in PAGES]
    for folder in ("tests", "benchmarks", "scripts", "backoff_core"):
        texts += [p.read_text() for p in (ROOT / folder).rglob("*.py")]
    texts += [p.read_text() for p in (ROOT / "scripts").glob("*.sh")]
    corpus = "\n".join(texts)
    unnamed = []
    for path in sorted(p for p in RESULTS.rglob("*") if p.is_file()):
        rel = path.relative_to(RESULTS)
        stem = path.name.split(".")[0]
        # a file inside a named folder (router_eval/) is named with its folder
        names = {str(rel), path.name, stem, *(str(parent) for parent in rel.parents if str(parent) != ".")}
        if not any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", corpus) for n in names):
            unnamed.append(str(rel))
    assert not unnamed


# --- the README's figures against their results files ---------------------------------------


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def agree(printed: str, value: float, scale: float = 1.0) -> bool:
    """`printed` (as the README writes it) is `value * scale` rounded to its own decimals."""
    decimals = len(printed.partition(".")[2])
    return abs(float(printed) - value * scale) <= 0.5 * 10**-decimals + 1e-9


def row(table_start: str, first_cell: str) -> list[str]:
    """The cells of the README table row that starts with `first_cell`, in the table after
    `table_start`."""
    rest = README[README.index(table_start) :]
    for line in rest.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].replace("**", "") == first_cell.replace("**", ""):
            return cells
    raise AssertionError(f"no row {first_cell!r} after {table_start!r}")


def numbers(cell: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?", cell.replace("**", ""))


GPU_TABLE = "| figure | eager layers | compiled (default) | goal |"


def test_readme_gpu_table_is_fused_step_h200():
    fused = load("gpu/fused_step-h200.json")
    auto = load("gpu/compiled_attention-h200-auto.json")["ways"]["auto"]
    eager, goals = fused["modes"]["off"], fused["goals"]

    _, off, on, _ = row(GPU_TABLE, "M_S step, 1 row, 1024 keys / 64 rows")
    ms_1, ms_64, kernels = numbers(off)[:3]
    assert agree(ms_1, eager["replays"]["small rows=1 keys=1024"]["replay_ms"])
    assert agree(ms_64, eager["replays"]["small rows=64 keys=1024"]["replay_ms"])
    assert int(kernels) == eager["replays"]["small rows=1 keys=1024"]["kernels"]
    ms_1, ms_64, least, most = numbers(on)[:4]
    assert agree(ms_1, auto["small rows=1 keys=1024"]["replay_ms"])
    assert agree(ms_64, auto["small rows=64 keys=1024"]["replay_ms"])
    assert (int(least), int(most)) == (
        auto["small rows=1 keys=1024"]["kernels"],
        auto["small rows=64 keys=1024"]["kernels"],
    )

    for mode, cell in zip(
        ("off", "on"), row(GPU_TABLE, "M_L alone, one stream: tok/s, share of HBM peak")[1:3], strict=True
    ):
        tok, share = numbers(cell)
        assert agree(tok, fused["modes"][mode]["rows"]["always-large"]["1"]["tok_per_s"])
        assert agree(share, goals[mode]["M_L_alone_over_peak"], 100)
    for mode, cell in zip(
        ("off", "on"), row(GPU_TABLE, "random b=0.9, one stream: tok/s, vs M_L alone")[1:3], strict=True
    ):
        tok, ratio = numbers(cell)
        assert agree(tok, goals[mode]["b09_tok_per_s_n1"])
        assert agree(ratio, goals[mode]["b09_over_M_L_alone_n1"])
    for mode, cell in zip(("off", "on"), row(GPU_TABLE, "b=0.9 vs always-large at 16 / 64 streams")[1:3], strict=True):
        at_16, at_64 = numbers(cell)
        assert agree(at_16, goals[mode]["b09_over_always_large_n16"])
        assert agree(at_64, goals[mode]["b09_over_always_large_n64"])
    for mode, cell in zip(("off", "on"), row(GPU_TABLE, "start-up of the 8B-shaped pair")[1:3], strict=True):
        assert agree(numbers(cell)[0], fused["modes"][mode]["load_s"])


def test_readme_batch_figure_is_batch_scaling_h200():
    tok = load("gpu/batch_scaling-h200.json")["tok_per_s"]["random b=0.9"]
    m = re.search(r"(\d+(?:\.\d+)?)x at b=0.9 \((\d+) → (\d+)\s+tok/s", README)
    assert m, "the README's 64-vs-one figure"
    ratio, one, many = m.groups()
    assert agree(one, tok["1"]) and agree(many, tok["64"]) and agree(ratio, tok["64"] / tok["1"])


def test_readme_step_overhead_is_step_overhead_json():
    ms = load("step_overhead.json")["ms_per_step"]
    m = re.search(r"\):\s+(\d\.\d+) ms at\s+64 streams always-small, (\d\.\d+) ms at\s+b=0.9 with batched", README)
    assert m, "the README's host work per step"
    assert agree(m.group(1), ms["static KV, always-small"]["64"])
    assert agree(m.group(2), ms["static KV, random b=0.9, batched catch-ups"]["64"])


def test_readme_prefix_routing_row_is_prefix_routing_json():
    totals = load("prefix_routing.json")["totals"]
    cell = row(
        "| measured (", "requests sent to a replica that had seen their system prompt (`benchmarks/prefix_routing.py`)"
    )[1]
    affinity, pow2, ceiling = numbers(cell.replace("power of two", ""))
    assert agree(affinity, totals["affinity"]["hit_share"])
    assert agree(pow2, totals["pow2"]["hit_share"])
    assert agree(ceiling, load("prefix_routing.json")["config"]["ceiling"])


def test_readme_in_flight_figure_is_serve_load_in_flight_json():
    m = re.search(r"at b=0.9: (\d+\.\d+)x the tok/s at 16 streams", README)
    assert m, "the README's in-flight figure"
    assert agree(m.group(1), load("serve_load-in-flight.json")["summary"]["in_flight_over_batched_tok_per_s"])


FRONTIER = "| row | backoff rate | mean accuracy | share of M_L's | tok/s, one stream |"


def test_readme_frontier_table_is_frontier_json():
    frontier = load("frontier.json")
    large = frontier["large_alone"]["mean_accuracy"]

    def check(cells: list[str], r: dict) -> None:
        rate, accuracy, share, tok = (c.replace("**", "") for c in cells[1:5])
        assert agree(rate, r["backoff_rate"]), cells
        assert agree(accuracy, r["mean_accuracy"]), cells
        assert agree(share, r["mean_accuracy"] / large), cells
        assert agree(tok, r["tok_per_s"]["1"]), cells

    check(row(FRONTIER, "M_L alone"), frontier["large_alone"])
    check(row(FRONTIER, "M_S alone"), frontier["small_alone"])
    shown = 0
    for r in frontier["rows"]:
        if r["router"] == "entropy":
            setting = f"{r['setting']:g}"
            first = "**packaged default (entropy 1.75)**" if setting == "1.75" else f"entropy {setting}"
        else:
            continue
        try:
            cells = row(FRONTIER, first)
        except AssertionError:
            continue  # the README shows some rows only
        check(cells, r)
        shown += 1
    classifier = row(FRONTIER, "classifier at its 30 % calibrated threshold")
    check(
        classifier,
        min((r for r in frontier["rows"] if r["router"] == "classifier"), key=lambda r: abs(r["setting"] - 0.3)),
    )
    assert shown >= 5


def test_readme_and_testing_page_suite_times_are_suite_time_json():
    tiers = load("suite_time.json")["tiers"]
    page = (ROOT / "docs" / "testing.md").read_text()
    for tier, target in (("fast", "make test-fast"), ("full", "make test")):
        m = re.search(rf"^\| `{target}` \|[^\n]*?\| (\d+\.\d+) min \((\d+) passed; goal ≤ (\d+)\) \|$", README, re.M)
        assert m, f"the README's {target} row"
        c = tiers[tier]["counts"]
        assert agree(m.group(1), tiers[tier]["wall_min"]) and int(m.group(2)) == c["passed"]
        assert float(m.group(3)) == tiers[tier]["goal_min"]
        m = re.search(rf"^\| `{target}` \| (\d+\.\d+) min \| \d+ min \| (\d+) \| (\d+) \| (\d+) \|$", page, re.M)
        assert m, f"docs/testing.md's {target} row"
        assert agree(m.group(1), tiers[tier]["wall_min"])
        assert [int(g) for g in m.groups()[1:]] == [c.get("passed", 0), c.get("skipped", 0), c.get("failed", 0)]


def test_readme_set_up_times_are_demo_time_and_suite_time_json():
    """The Set-up section's times: `make demo` (benchmarks/demo_time.py) and both test tiers."""
    m = re.search(
        r"`make demo` takes (\d+) s .*?`make test` (\d+\.\d+) min and `make test-fast` (\d+\.\d+) min", README, re.S
    )
    assert m, "the README's Set-up times"
    tiers = load("suite_time.json")["tiers"]
    assert agree(m.group(1), load("demo_time.json")["wall_s_best"])
    assert agree(m.group(2), tiers["full"]["wall_min"]) and agree(m.group(3), tiers["fast"]["wall_min"])


def _bash_block(text: str, needle: str) -> list[str]:
    """The lines of the first ```bash block of `text` that holds `needle`."""
    block = next(b for b in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M) if needle in b)
    return [line for line in block.splitlines() if line.strip()]


def test_the_readmes_live_reload_commands_carry_what_rays_cli_needs(capsys):
    """Issue 57: `serve deploy` against the Ray `backoff serve` starts needs RAY_AUTH_MODE=token
    in its shell. The README's block exports every variable `backoff serve` tells such a shell
    to (serve_cli.live_reload_hint, which tests/deployments/test_app_input_access.py runs Ray's
    CLI with), before Ray's CLI runs; it deploys the file its --print-config line writes, that
    file is a Serve config with the live user_config, and the alternative command parses."""
    pytest.importorskip("ray")
    from ray.serve.schema import ServeDeploySchema

    from deployments import serve_cli

    lines = _bash_block(README, "serve deploy")
    code = [line.split("  #")[0].strip() for line in lines]
    deploy = next(i for i, line in enumerate(code) if re.match(r"^(\S*/)?serve deploy ", line))
    exports = [h.strip() for h in serve_cli.live_reload_hint("token", None) if h.strip().startswith("export ")]
    assert exports and all(e in code[:deploy] for e in exports), (exports, code)
    printed = next(line for line in code[:deploy] if "--print-config" in line)
    command, target = printed.split(">")
    assert code[deploy].split()[2] == target.strip()
    argv = shlex.split(command)
    assert argv[:2] == [".venv/bin/backoff", "serve"]
    assert serve_cli.main(argv[2:]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    ServeDeploySchema.model_validate(config)
    small = {d["name"]: d for d in config["applications"][0]["deployments"]}["SmallModel"]
    assert "thresholds" in small["user_config"]  # what the comment says to edit
    other = shlex.split(lines[deploy].split("# or: ")[1])
    assert other[:2] == [".venv/bin/backoff", "serve"] and "auto" in other
    serve_cli._parser().parse_args(other[2:])


def test_fp8_quality_tables_are_fp8_quality_json():
    quality, page = load("fp8_quality.json"), (ROOT / "docs" / "fp8.md").read_text()
    rows = [
        [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]
        for line in page[page.index("## Quality on the real pair") :].splitlines()
        if line.startswith("|")
    ]

    def cells(*words: str) -> list[str]:
        """The numbers of the one row whose first cell starts with words[0] and holds the rest."""
        found = [r[1:] for r in rows if r[0].startswith(words[0]) and all(w in r[0] for w in words[1:])]
        assert len(found) == 1, f"docs/fp8.md: {len(found)} rows {words}"
        return found[0]

    for model, label in (("large", "M_L"), ("small", "M_S")):
        for method, figures in (("GPTQ", quality["gptq"]), ("round-to-nearest", quality)):
            for form, key in (("weight-only", "weight_only"), ("W8A8", "models")):
                r, shown = figures[key][model], cells(label, method, form)
                assert agree(shown[0], r["top1_agreement"]), (label, method, form)
                assert agree(shown[1], r["mean_kl"]) and agree(shown[2], r["p99_kl"]), (label, method, form)
    r, shown = quality["checkpoint"]["large"], cells("M_L from `backoff quantize")
    assert agree(shown[0], r["top1_agreement"]) and agree(shown[1], r["mean_kl"]) and agree(shown[2], r["p99_kl"])
    tasks = cells("mean accuracy")
    keys = ("full", "fp8", "fp8_gptq", "fp8_gptq_weight_only")
    assert all(agree(p, quality["tasks"][k]) for p, k in zip(tasks, keys, strict=False))


def test_the_testing_pages_cpu_by_module_and_by_test_is_module_cpu_json():
    record = load("module_cpu.json")
    page = (ROOT / "docs" / "testing.md").read_text()
    by_name = {Path(m["module"]).name: m for m in record["modules"]}
    rows = re.findall(r"^\| `(test_\w+\.py)` \| (\d+\.\d) \| (\d+\.\d) \|$", page, re.M)
    assert len(rows) >= 5, "docs/testing.md's CPU-by-module table"
    assert [name for name, *_ in rows] == [Path(m["module"]).name for m in record["modules"][: len(rows)]]
    for name, cpu, wall in rows:
        assert float(cpu) == by_name[name]["cpu_s"] and float(wall) == by_name[name]["wall_s"], name
    tests = re.findall(r"^\| `(test_\w+\.py::[^`]+)` \| (\d+\.\d+) \| (\d+\.\d+) \|$", page, re.M)
    assert len(tests) >= 5, "docs/testing.md's CPU-by-test table"
    for (name, cpu, setup), t in zip(tests, record["tests"], strict=False):
        assert name == t["test"].rsplit("/", 1)[-1] and float(cpu) == t["cpu_s"] and float(setup) == t["setup_cpu_s"]
    prose = " ".join(page.split())  # the paragraphs as one line: a rewrap breaks no pattern
    m = re.search(r"\(tests/, at (\w+),.*? took ([\d,]+) CPU-s in ([\d,]+) s", prose)
    assert m and m.group(1) == record["commit"], "the run's commit"
    assert agree(m.group(2).replace(",", ""), record["cpu_s"]) and agree(m.group(3).replace(",", ""), record["wall_s"])
    floor = re.search(r"a floor of ([\d.]+) min", prose)
    assert floor and float(floor.group(1)) == record["floor_min"], "the floor"
    ray = re.search(r"the (\d+) tests of the Ray modules took ([\d,]+) CPU-s, ([\d,]+) of them in their setups", prose)
    assert ray, "the Ray modules' share"
    cpu, setup = (g.replace(",", "") for g in ray.group(2, 3))
    assert int(ray.group(1)) == record["ray"]["tests"]
    assert agree(cpu, record["ray"]["cpu_s"]) and agree(setup, record["ray"]["setup_cpu_s"])


def test_the_cluster_pages_autoscaling_figures_are_autoscaling_json():
    record = load("autoscaling.json")
    meta, page = record["meta"], " ".join((ROOT / "docs" / "cluster.md").read_text().split())  # one line
    m = re.search(
        r"(\d+) concurrent always-large requests \((\d+) tokens each, every catch-up delayed (\d+) ms\)", page
    )
    assert m and int(m.group(1)) == meta["streams"], "the burst's requests"
    assert meta["request"] == f"{m.group(2)} tokens, always-large, {m.group(3)} ms delay per catch-up"
    m = re.search(r"then 3 s more: ([\d.]+) s, (\d+) completed, (\d+) refused", page)
    assert (
        m
        and agree(m.group(1), meta["burst_s"])
        and [int(g) for g in m.groups()[1:]] == [meta["completed"], meta["refused"]]
    )
