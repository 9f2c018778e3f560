"""Where the suite's CPU goes, by module and by test: the tests run serially (no xdist) inside a
cpuacct cgroup, so the CPU of every process a module starts -- Ray's daemons, its replicas, the
subprocesses of a CLI test -- is counted against it, beside its wall time.

    sudo python benchmarks/module_cpu.py                          # tests/ -> benchmarks/results/module_cpu.json
    sudo python benchmarks/module_cpu.py tests/deployments -x     # any pytest arguments

`make test` is CPU-bound on two cores (benchmarks/results/suite_time.json: the tree uses ~1.8
of them), so a module's CPU-seconds, not its wall time under xdist, say what it costs the
run. A module's figure runs from its first test's setup to the next module's first (its
module-scoped teardown, a Serve app going down, falls in the next); a shared Ray or app is
counted where it starts. A test's figure likewise runs from its setup to the next test's, its
setup's CPU apart (a module's first test carries the module's app deploy or compile). The
record's `floor_min` is the CPU over the cores: the shortest the suite can take on this
machine with every core busy all the time. Needs a writable cgroup v1 cpuacct hierarchy (root).

The same file is the pytest plugin that records the figures (`-p benchmarks.module_cpu`,
reading MODULE_CPU_USAGE and MODULE_CPU_OUT from the environment).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # as a script: the checkout's packages
from tests.support.tiers import starts_ray  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "module_cpu.json"
CGROUPS = Path("/sys/fs/cgroup/cpuacct")
TEST_MIN_CPU_S = 1.0  # the record lists the tests that cost this much or more


# -- the plugin (in the pytest process) ----------------------------------------------------------

_current: dict = {"module": None, "t": 0.0, "cpu": 0.0}
_test: dict = {"id": None, "t": 0.0, "cpu": 0.0, "setup": 0.0}


def _usage_s(usage: Path) -> float:
    """A cpuacct.usage file's CPU-seconds (it counts nanoseconds)."""
    return int(usage.read_text()) / 1e9


def _cpu_s() -> float:
    return _usage_s(Path(os.environ["MODULE_CPU_USAGE"]))


def _write(*fields) -> None:
    with open(os.environ["MODULE_CPU_OUT"], "a") as out:
        out.write("\t".join(map(str, fields)) + "\n")


def _flush(now: float, cpu: float) -> None:
    if _current["module"] is not None:
        _write("module", _current["module"], f"{now - _current['t']:.1f}", f"{cpu - _current['cpu']:.1f}")


def _flush_test(now: float, cpu: float) -> None:
    if _test["id"] is not None:
        _write("test", _test["id"], f"{now - _test['t']:.2f}", f"{cpu - _test['cpu']:.2f}", f"{_test['setup']:.2f}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """A test's figures run from its setup to the next test's (its teardown, a module-scoped
    fixture's included, falls in it); its setup's CPU apart (a module's app deploy, a compile)."""
    now, cpu = time.monotonic(), _cpu_s()
    _flush_test(now, cpu)
    module = item.nodeid.split("::", 1)[0]
    if module != _current["module"]:
        _flush(now, cpu)
        _current.update(module=module, t=now, cpu=cpu)
    _test.update(id=item.nodeid, t=now, cpu=cpu, setup=0.0)
    yield
    _test["setup"] = _cpu_s() - cpu


def pytest_sessionfinish(session) -> None:
    now, cpu = time.monotonic(), _cpu_s()
    _flush_test(now, cpu)
    _flush(now, cpu)


# -- the run ---------------------------------------------------------------------------------------


def _cgroup(name: str) -> Path:
    group = CGROUPS / name
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        raise SystemExit(f"module_cpu: needs a writable cpuacct cgroup (v1) at {CGROUPS}: {exc}") from exc
    return group / "cpuacct.usage"


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def summary(rows: list[list[str]], cpus: int) -> dict:
    """The plugin's rows as the record's figures: modules by CPU; the tests of TEST_MIN_CPU_S
    or more (their setup's CPU apart); totals of the Ray modules (tests/support/tiers.py) and
    of every test's setup; the shortest wall the CPU allows with every core busy."""
    modules = sorted(
        ({"module": m, "wall_s": float(w), "cpu_s": float(c)} for kind, m, w, c, *_ in rows if kind == "module"),
        key=lambda r: -r["cpu_s"],
    )
    tests = [
        {"test": t, "wall_s": float(w), "cpu_s": float(c), "setup_cpu_s": float(s)}
        for kind, t, w, c, s in (r for r in rows if r[0] == "test")
    ]
    ray = [t for t in tests if starts_ray(t["test"].split("::", 1)[0])]
    total = sum(t["cpu_s"] for t in tests)

    def cpu(of: list[dict], key: str = "cpu_s") -> float:
        return round(sum(t[key] for t in of), 1)

    return {
        "floor_min": round(total / cpus / 60, 2),
        "tests_cpu_s": round(total, 1),
        "setup_cpu_s": cpu(tests, "setup_cpu_s"),
        "ray": {"tests": len(ray), "cpu_s": cpu(ray), "setup_cpu_s": cpu(ray, "setup_cpu_s")},
        "modules": modules,
        "tests": sorted((t for t in tests if t["cpu_s"] >= TEST_MIN_CPU_S), key=lambda t: -t["cpu_s"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cgroup", default="backoff-module-cpu", help="the cpuacct group's name")
    args, pytest_args = parser.parse_known_args(argv)
    usage = _cgroup(args.cgroup)
    figures = args.out.with_suffix(".partial.tsv")
    figures.parent.mkdir(parents=True, exist_ok=True)
    figures.unlink(missing_ok=True)
    env = dict(os.environ, MODULE_CPU_USAGE=str(usage), MODULE_CPU_OUT=str(figures))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "benchmarks.module_cpu"]
    cmd += pytest_args or ["tests"]
    start, cpu0 = time.monotonic(), _usage_s(usage)
    done = subprocess.run(cmd, cwd=ROOT, env=env)
    wall, cpu = time.monotonic() - start, _usage_s(usage) - cpu0
    rows = [line.split("\t") for line in figures.read_text().splitlines()] if figures.exists() else []
    record = {
        "commit": _commit(),
        "command": " ".join(["python benchmarks/module_cpu.py", *(pytest_args or [])]),
        "cpus": os.cpu_count(),
        "returncode": done.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        **summary(rows, os.cpu_count() or 1),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    figures.unlink(missing_ok=True)
    print(
        f"{wall:.0f} s, {cpu:.0f} CPU-s (on {record['cpus']} cores at least {record['floor_min']} min); the most CPU:"
    )
    for row in record["modules"][:15]:
        print(f"  {row['cpu_s']:7.1f} CPU-s {row['wall_s']:7.1f} s  {row['module']}")
    print(f"saved {args.out}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
