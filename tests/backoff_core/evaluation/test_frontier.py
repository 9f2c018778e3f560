"""`backoff frontier` on the tiny pair: the JSON's schema, M_L / M_S alone and the default
row, the plot, and a run that resumes from its cached rows (and redoes rows measured with
another configuration)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")  # the eval extra; CI installs it (Makefile)

from backoff_core.cli.main import main  # noqa: E402
from backoff_core.evaluation.frontier import (  # noqa: E402
    FrontierConfig,
    Setting,
    best_kept,
    cached_rows,
    evaluate_row,
    markdown_table,
    remeasure_speed,
    run_frontier,
)
from backoff_core.evaluation.frontier_spec import DEFAULT_ROUTING  # noqa: E402
from tests.support.helpers import engine_for  # noqa: E402

TASKS = "backoff_everyday_mc,backoff_python_qa"
ROW_KEYS = {"router", "setting", "backoff_rate", "accuracy", "mean_accuracy", "tok_per_s"}


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory, soft_pair, tokenizer):
    root = tmp_path_factory.mktemp("pair")
    for name, model in zip(("small", "large"), soft_pair):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root / "small", root / "large"


def test_frontier_writes_the_schema_and_the_plot(pair_dirs, tmp_path):
    small, large = pair_dirs
    argv = ["frontier", "--small", str(small), "--large", str(large), "--grid", "entropy=1,3", "--grid", "random=0.5"]
    argv += ["--tasks", TASKS, "--limit", "3", "--speed-tokens", "3", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    frontier = json.loads((tmp_path / "frontier.json").read_text())
    assert set(frontier) == {"pair", "tasks", "rows", "large_alone", "small_alone", "default"}
    assert frontier["pair"] == f"{small}+{large}" and frontier["tasks"] == TASKS.split(",")
    default_key = (DEFAULT_ROUTING.router, DEFAULT_ROUTING.thresholds[0])
    assert {(r["router"], r["setting"]) for r in frontier["rows"]} == {
        ("entropy", 1.0), ("entropy", 3.0), default_key, ("random", 0.5)
    }  # fmt: skip
    for row in [*frontier["rows"], frontier["large_alone"], frontier["small_alone"]]:
        assert set(row) == ROW_KEYS
        assert set(row["accuracy"]) == set(TASKS.split(","))
        assert row["mean_accuracy"] == pytest.approx(sum(row["accuracy"].values()) / 2)
        assert set(row["tok_per_s"]) == {"1", "16"} and min(row["tok_per_s"].values()) > 0
    assert frontier["large_alone"]["backoff_rate"] == 0.0 and frontier["small_alone"]["backoff_rate"] == 1.0
    default = frontier["default"]
    assert set(default) == {"router", "setting", "backoff_rate", "mean_accuracy", "accuracy_ratio", "speedup_vs_large"}
    row = next(r for r in frontier["rows"] if (r["router"], r["setting"]) == default_key)
    large_alone = frontier["large_alone"]
    assert default["speedup_vs_large"] == pytest.approx(row["tok_per_s"]["1"] / large_alone["tok_per_s"]["1"])
    if large_alone["mean_accuracy"]:
        assert default["accuracy_ratio"] == pytest.approx(row["mean_accuracy"] / large_alone["mean_accuracy"])
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    assert len(markdown_table(frontier).splitlines()) == 2 + 6  # header, rule, M_L, M_S, 4 rows
    assert len(list((tmp_path / "frontier_rows").glob("*.json"))) == 6
    # the report alone, from the cached rows (no model loaded): the same figures
    (tmp_path / "frontier.json").unlink()
    assert main([*argv, "--report-only"]) == 0
    report = json.loads((tmp_path / "frontier.json").read_text())
    key = lambda r: (r["router"], r["setting"])
    assert sorted(report.pop("rows"), key=key) == sorted(frontier.pop("rows"), key=key)
    assert report == frontier


def test_a_run_resumes_from_its_cached_rows(soft_pair, tokenizer, tmp_path):
    engine = engine_for(soft_pair, tokenizer)
    config = FrontierConfig(pair="tiny", tasks=("backoff_everyday_mc",), limit=2, speed_tokens=2)
    settings = [Setting("entropy", 2.0), Setting("random", 0.5)]
    calls = []

    def interrupted(engine, setting, config):
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed mid-run
        calls.append(setting)
        return evaluate_row(engine, setting, config)

    with pytest.raises(KeyboardInterrupt):
        run_frontier(engine, settings, config, tmp_path, evaluate=interrupted)
    assert len(list(tmp_path.glob("*.json"))) == 3
    again = []
    frontier = run_frontier(
        engine, settings, config, tmp_path, evaluate=lambda e, s, c: again.append(s) or evaluate_row(e, s, c)
    )
    assert again == [Setting("entropy", 2.0), Setting("random", 0.5)]  # only the rows not yet measured
    assert len(frontier["rows"]) == 3  # the packaged default, entropy 2, random 0.5
    assert best_kept(frontier, keep=0.0) in frontier["rows"]
    # tokens/s of every cached row measured again side by side: new figures, the rest kept
    remeasure_speed(engine, config, tmp_path, repeats=1)
    again_rows = cached_rows(config, tmp_path)
    assert again_rows["large_alone"]["accuracy"] == frontier["large_alone"]["accuracy"]
    assert again_rows["large_alone"]["tok_per_s"] != frontier["large_alone"]["tok_per_s"]
    # another configuration measures every row again
    redo = []
    other = FrontierConfig(pair="tiny", tasks=("backoff_everyday_mc",), limit=3, speed_tokens=2)
    run_frontier(engine, [], other, tmp_path, evaluate=lambda e, s, c: redo.append(s) or evaluate_row(e, s, c))
    assert len(redo) == 3  # M_L alone, M_S alone, the default: cached, but under another configuration


def test_edited_task_files_are_another_configuration(tmp_path):
    """A cached row measured on other items is not reused: the task files are in the fingerprint."""
    import shutil

    from backoff_core.evaluation.frontier_spec import tasks_dir

    folder = tmp_path / "tasks"
    shutil.copytree(tasks_dir(), folder)
    config = FrontierConfig(pair="tiny", include_path=str(folder))
    before = config.fingerprint()
    assert FrontierConfig(pair="tiny", include_path=str(folder)).fingerprint() == before
    items = folder / "everyday_mc.jsonl"
    items.write_text(items.read_text().replace("blue", "azure", 1))
    assert config.fingerprint() != before


def test_other_weights_or_another_head_are_another_configuration(pair_dirs, tmp_path):
    """A re-distilled M_S saved where the old one was must not reuse the old rows, nor a
    retrained head the old classifier rows: the files are in the fingerprint, by content."""
    import shutil

    from backoff_core.evaluation.frontier import files_digest

    small = tmp_path / "small"
    shutil.copytree(pair_dirs[0], small)
    head = tmp_path / "head"
    head.mkdir()
    (head / "head.json").write_text('{"layer": 2}')
    files = [small, pair_dirs[1], head]
    before = files_digest(files)
    assert files_digest(files) == before
    weights = next(small.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    after_weights = files_digest(files)
    assert after_weights != before
    (head / "head.json").write_text('{"layer": 4}')
    assert files_digest(files) != after_weights
    assert files_digest(["not-a-local-path/model"]) != files_digest(["another/model"])
    config = FrontierConfig(pair="tiny", models=before, head="h1")
    assert FrontierConfig(pair="tiny", models=after_weights, head="h1").fingerprint() != config.fingerprint()
    # another head: another key for classifier rows only
    other_head = FrontierConfig(pair="tiny", models=before, head="h2")
    assert other_head.row_fingerprint("entropy") == config.row_fingerprint("entropy")
    assert other_head.row_fingerprint("classifier") != config.row_fingerprint("classifier")
    # a model card or a plot written beside the weights later is the same model
    after_head = files_digest(files)
    (small / "MODEL_CARD.md").write_text("# measured since")
    (head / "calibration.png").write_bytes(b"png")
    assert files_digest(files) == after_head
