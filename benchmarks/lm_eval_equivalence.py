"""`--model backoff` (always-large) against lm-eval's own `--model hf` on M_L, item for item,
on the shipped task set and the embedded default pair.

    python benchmarks/lm_eval_equivalence.py [--limit N]     # ~5 min on 2 idle CPU cores

Runs `backoff lm-eval` twice with --log_samples (hf: M_L written out dense, float32, cpu;
backoff: router=always-large), then compares every item: the score, every loglikelihood
(max absolute difference) and greedy flag of the multiple-choice tasks, every generation of
the short-answer tasks. Prints and writes benchmarks/results/lm_eval_equivalence.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("backoff_everyday_mc", "backoff_everyday_qa", "backoff_python_mc", "backoff_python_qa")


def _samples(out: Path, task: str) -> dict[int, dict]:
    rows = {}
    for path in out.rglob(f"samples_{task}_*.jsonl"):
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            rows[sample["doc_id"]] = sample
    return rows


def compare(hf_out: Path, backoff_out: Path, tasks=TASKS) -> dict:
    """Per task: items, items scored the same, and the loglikelihoods' / generations' agreement."""
    report = {}
    for task in tasks:
        hf, bk = _samples(hf_out, task), _samples(backoff_out, task)
        if hf.keys() != bk.keys() or not hf:
            raise RuntimeError(f"{task}: the two runs scored different items ({len(hf)} vs {len(bk)})")
        metric = "acc" if "acc" in next(iter(hf.values())) else "exact_match"
        row = {
            "items": len(hf),
            "same_score": sum(hf[i][metric] == bk[i][metric] for i in hf),
            "accuracy_hf": sum(s[metric] for s in hf.values()) / len(hf),
            "accuracy_backoff": sum(s[metric] for s in bk.values()) / len(bk),
        }
        if metric == "acc":  # resps: per choice [[loglikelihood, is_greedy]]
            pairs = [(a[0], b[0]) for i in hf for a, b in zip(hf[i]["resps"], bk[i]["resps"], strict=True)]
            row["loglikelihoods"] = len(pairs)
            row["max_abs_diff"] = max(abs(float(a[0]) - float(b[0])) for a, b in pairs)
            row["same_greedy_flag"] = sum(a[1] == b[1] for a, b in pairs)
        else:
            row["same_generation"] = sum(hf[i]["filtered_resps"] == bk[i]["filtered_resps"] for i in hf)
        report[task] = row
    return report


def _lm_eval(args: list[str], out: Path, limit: int | None) -> float:
    run = "import sys; from backoff_core.cli import main; sys.exit(main())"
    command = [sys.executable, "-c", run, "lm-eval", *args, "--tasks", ",".join(TASKS)]
    command += ["--log_samples", "--output_path", str(out)] + (["--limit", str(limit)] if limit else [])
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lm_eval_equivalence.json"))
    args = parser.parse_args()
    from backoff_core.models.default_pair import find_large_gguf
    from backoff_core.models.gguf_cache import load_gguf

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, tokenizer = load_gguf(find_large_gguf())  # the cached conversion (~1.5 s warm)
        model.save_pretrained(tmp / "large")
        tokenizer.save_pretrained(tmp / "large")
        del model
        seconds = {
            "hf": _lm_eval(
                ["--model", "hf", "--model_args", f"pretrained={tmp / 'large'},dtype=float32", "--device", "cpu"]
                + ["--batch_size", "16"],
                tmp / "hf",
                args.limit,
            ),
            "backoff": _lm_eval(
                ["--model", "backoff", "--model_args", "router=always-large"], tmp / "backoff", args.limit
            ),
        }
        report = compare(tmp / "hf", tmp / "backoff")
    result = {
        "pair": "default (SmolLM2-135M-Instruct Q4_1 as M_L)",
        "limit": args.limit,
        "tasks": report,
        "identical": all(r["same_score"] == r["items"] for r in report.values()),
        "seconds": seconds,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
