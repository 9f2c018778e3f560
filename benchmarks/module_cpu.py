"""Where the suite's CPU goes, by module: the tests run serially (no xdist) inside a cpuacct
cgroup, so the CPU of every process a module starts -- Ray's daemons, its replicas, the
subprocesses of a CLI test -- is counted against it, beside its wall time.

    sudo python benchmarks/module_cpu.py                          # tests/ -> benchmarks/results/module_cpu.json
    sudo python benchmarks/module_cpu.py tests/deployments -x     # any pytest arguments

`make test` is CPU-bound on two cores (benchmarks/results/suite_time.json: the tree uses ~1.8
of them), so a module's CPU-seconds, not its wall time under xdist, say what it costs the
run. A module's figure runs from its first test's setup to the next module's first (its
module-scoped teardown, a Serve app going down, falls in the next); a shared Ray or app is
counted where it starts. Needs a writable cgroup v1 cpuacct hierarchy (root).

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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "module_cpu.json"
CGROUPS = Path("/sys/fs/cgroup/cpuacct")


# -- the plugin (in the pytest process) ----------------------------------------------------------

_current: dict = {"module": None, "t": 0.0, "cpu": 0.0}


def _usage_s(usage: Path) -> float:
    """A cpuacct.usage file's CPU-seconds (it counts nanoseconds)."""
    return int(usage.read_text()) / 1e9


def _cpu_s() -> float:
    return _usage_s(Path(os.environ["MODULE_CPU_USAGE"]))


def _flush(now: float, cpu: float) -> None:
    if _current["module"] is not None:
        with open(os.environ["MODULE_CPU_OUT"], "a") as out:
            out.write(f"{_current['module']}\t{now - _current['t']:.1f}\t{cpu - _current['cpu']:.1f}\n")


def pytest_runtest_setup(item) -> None:
    module = item.nodeid.split("::", 1)[0]
    if module != _current["module"]:
        now, cpu = time.monotonic(), _cpu_s()
        _flush(now, cpu)
        _current.update(module=module, t=now, cpu=cpu)


def pytest_sessionfinish(session) -> None:
    _flush(time.monotonic(), _cpu_s())


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
    modules = sorted(
        ({"module": m, "wall_s": float(w), "cpu_s": float(c)} for m, w, c in rows), key=lambda r: -r["cpu_s"]
    )
    record = {
        "commit": _commit(),
        "command": " ".join(["python benchmarks/module_cpu.py", *(pytest_args or [])]),
        "cpus": os.cpu_count(),
        "returncode": done.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "modules": modules,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    figures.unlink(missing_ok=True)
    print(f"{wall:.0f} s, {cpu:.0f} CPU-s; the most CPU:")
    for row in modules[:15]:
        print(f"  {row['cpu_s']:7.1f} CPU-s {row['wall_s']:7.1f} s  {row['module']}")
    print(f"saved {args.out}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
