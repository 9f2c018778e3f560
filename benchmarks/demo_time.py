"""Wall time of `make demo` on this machine, as the README states it: the command a newcomer
runs first, on a .venv already made (`make venv`'s installs are not timed) and the default
pair's converted copy cached (its first load adds the conversion: benchmarks/startup.py).

    python benchmarks/demo_time.py            # 3 runs; saves benchmarks/results/demo_time.json

The figure is the best of the runs (timeit's rule): on a shared machine the others measure
what else ran meanwhile (all are saved, with the load average at the start). The times of
`make test` / `make test-fast` are benchmarks/suite_time.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "demo_time.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    walls = []
    for _ in tqdm(range(args.runs), desc="make demo"):
        start = time.perf_counter()
        subprocess.run(["make", "-s", "demo"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        walls.append(round(time.perf_counter() - start, 1))
    out = {
        "what": "make demo on an existing .venv, the default pair's converted copy cached",
        "wall_s": walls,
        "wall_s_best": min(walls),
        "wall_s_median": statistics.median(walls),
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "date": time.strftime("%Y-%m-%d"),
    }
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
