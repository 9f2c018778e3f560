"""Start-up time of the default pair: the first (cold) load that converts the GGUF and fills
the converted-model cache, against warm loads that read it (backoff_core/models/gguf_cache.py).

    python benchmarks/startup.py                  # 1 cold + 5 warm loads, each in a fresh process

Every load runs in its own Python process (as a CLI call or a Serve replica would), against a
fresh cache folder made for this run, so the user's cache is neither read nor touched. Each
process reports the seconds of `load_default_pair()` alone and of its imports (torch +
transformers, paid by any start whatever the cache). Saves benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results" / "startup.json"

# One load in a fresh interpreter; prints one JSON line last.
_CHILD = """
import json, time
t0 = time.perf_counter()
import torch
from backoff_core.models.default_pair import load_default_pair
t1 = time.perf_counter()
small, large, tokenizer = load_default_pair()
t2 = time.perf_counter()
ids = tokenizer("The Python standard library", return_tensors="pt").input_ids
with torch.inference_mode():
    out = large.generate(ids, max_new_tokens=8, do_sample=False)
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "greedy": out[0].tolist()}))
"""


def one_load(cache_dir: Path, threads: int) -> dict:
    env = dict(os.environ, BACKOFF_CACHE_DIR=str(cache_dir), OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"load failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), process_s=wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=5, help="warm loads (the median is the figure)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="backoff-startup-") as cache_dir:
        runs = []
        for i in tqdm(range(1 + args.warm), desc="default-pair loads (1 cold, then warm)", unit="load"):
            runs.append(dict(one_load(Path(cache_dir), args.threads), kind="cold" if i == 0 else "warm"))
        entry_bytes = sum(p.stat().st_size for p in Path(cache_dir).rglob("*") if p.is_file())

    cold, warm = runs[0], runs[1:]
    if any(r["greedy"] != cold["greedy"] for r in warm):
        raise RuntimeError("a warm load generated other tokens than the cold one")
    result = {
        "what": "load_default_pair() in a fresh process: cold = GGUF conversion + writing the cache, warm = cache read",
        "cold_load_s": round(cold["load_s"], 2),
        "warm_load_s_median": round(statistics.median(r["load_s"] for r in warm), 2),
        "warm_load_s": [round(r["load_s"], 2) for r in warm],
        "speedup": round(cold["load_s"] / statistics.median(r["load_s"] for r in warm), 1),
        "import_s_median": round(statistics.median(r["import_s"] for r in runs), 2),
        "process_s": {
            "cold": round(cold["process_s"], 2),
            "warm_median": round(statistics.median(r["process_s"] for r in warm), 2),
        },
        "cache_entry_mb": round(entry_bytes / 2**20, 1),
        "same_greedy_tokens": True,
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"cold {result['cold_load_s']} s, warm median {result['warm_load_s_median']} s "
        f"({result['speedup']}x); imports {result['import_s_median']} s; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
