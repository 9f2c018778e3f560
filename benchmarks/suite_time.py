"""How long the test tiers take: `make test-fast` and `make test` as a developer runs them,
timed on this machine, with each tier's counts, its slowest tests and where its time goes by
module (from pytest's JUnit XML, which PYTEST_ADDOPTS asks for).

    python benchmarks/suite_time.py                     # both tiers -> benchmarks/results/suite_time.json
    python benchmarks/suite_time.py --tiers fast        # the inner loop alone (the other tier's record kept)

The goals (issue 58): `make test` <= 12 min and `make test-fast` <= 3 min on a quiet 2-core
machine. A busy machine runs both slower: the JSON records the load average beside each tier.
The results file is replaced only when every tier asked for has run (the figures so far go to
a `.partial` file beside it): tests/test_docs.py reads it while `make test` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "suite_time.json"
TIERS = {"fast": "test-fast", "full": "test"}  # tier -> make target
GOALS_MIN = {"fast": 3.0, "full": 12.0}
FAILURE_CHARS = 2000  # of a failed test's message, kept in the record
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected)")


def run_tier(tier: str, workers: int) -> dict:
    """`make <target>`, its output streamed through; wall time, counts, slowest tests, modules."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = dict(os.environ, PYTEST_ADDOPTS=f"--junitxml={xml} -p no:cacheprovider")
        load = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run(
            ["make", "-s", TIERS[tier], f"TEST_WORKERS={workers}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wall = time.perf_counter() - start
        sys.stdout.write(done.stdout[-3000:])
        cases = _cases(xml) if xml.exists() else []
        failures = _failures(xml) if xml.exists() else []
    tail = next((line for line in reversed(done.stdout.splitlines()) if SUMMARY.search(line) and " in " in line), "")
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in SUMMARY.findall(tail)}
    modules = Counter()
    for seconds, nodeid in cases:
        modules[nodeid.split("::", 1)[0]] += seconds
    return {
        "target": f"make {TIERS[tier]}",
        "workers": workers,
        "returncode": done.returncode,
        "wall_s": round(wall, 1),
        "wall_min": round(wall / 60, 2),
        "goal_min": GOALS_MIN[tier],
        "met": done.returncode == 0 and wall / 60 <= GOALS_MIN[tier],
        "load_average_at_start": round(load, 2),
        "counts": counts,
        "test_seconds_sum": round(sum(s for s, _ in cases), 1),
        "failures": failures,
        "slowest": [{"test": n, "s": round(s, 2)} for s, n in sorted(cases, reverse=True)[:25]],
        "modules": [{"module": m, "s": round(s, 1)} for m, s in modules.most_common(25)],
    }


def _cases(xml: Path) -> list[tuple[float, str]]:
    """(seconds, nodeid) of every test case in the JUnit file (setup and teardown included)."""
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        cases.append((float(case.get("time", 0)), f"{path}.py::{case.get('name')}"))
    return cases


def _failures(xml: Path) -> list[dict[str, str]]:
    """Each failed or erred test case and the first FAILURE_CHARS of its message (make's output
    keeps only its tail: a failure's reason would otherwise be lost with the run)."""
    found = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        for outcome in ("failure", "error"):
            for node in case.iter(outcome):
                path = case.get("classname", "").replace(".", "/")
                text = node.get("message") or node.text or ""
                found.append({"test": f"{path}.py::{case.get('name')}", outcome: text[:FAILURE_CHARS]})
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiers", default="fast,full", help="comma-separated: fast, full")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (TEST_WORKERS, as the Makefile)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        parser.error(f"unknown tier(s) {unknown}: choose from {sorted(TIERS)}")
    kept = json.loads(args.out.read_text())["tiers"] if args.out.exists() else {}
    report = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "tiers": kept}
    partial = args.out.with_name(args.out.stem + ".partial.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for tier in tiers:
        print(f"== {tier}: make {TIERS[tier]} (TEST_WORKERS={args.workers})", flush=True)
        report["tiers"][tier] = run_tier(tier, args.workers)
        partial.write_text(json.dumps(report, indent=2) + "\n")  # saved after every tier
    partial.replace(args.out)
    print(f"\n{'tier':<6} {'wall (min)':>10} {'goal':>6} {'passed':>7} {'failed':>7} {'skipped':>8}")
    for tier, row in ((t, report["tiers"][t]) for t in tiers):
        c = row["counts"]
        print(
            f"{tier:<6} {row['wall_min']:>10.2f} {row['goal_min']:>6.1f} {c.get('passed', 0):>7}"
            f" {c.get('failed', 0) + c.get('error', 0):>7} {c.get('skipped', 0):>8}"
        )
    print(f"saved {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0 if all(report["tiers"][t]["returncode"] == 0 for t in tiers) else 1


if __name__ == "__main__":
    sys.exit(main())
