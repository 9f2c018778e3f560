"""A catch-up's time with M_L over 1, 2 and 3 tensor-parallel ranks, on this machine's CPU.

    python benchmarks/tensor_parallel.py     # -> benchmarks/results/tensor_parallel.{json,png}

M_L is the default pair's (SmolLM2-135M: 30 layers, 9 heads, 3 KV heads; TP=2 cannot split
it), on oneDNN kernels as served. Each configuration prefills a PROMPT-token session once,
then times REPEATS catch-ups of k pending tokens (the session cropped back after each, so
every one reads the same cache; the configurations take turns, repeat by repeat), and reports their median wall time on rank 0, the share of
it rank 0 spent in collectives (the all-reduces, and the head's gather: waiting for the
slowest rank included), and the largest logit difference from TP=1 (each must be < 1e-4).
Both LM-head splits of backoff_core/parallel/sharding.py are measured: "vocab" (each rank
1/N of the vocabulary, one gather) and "rank0" (the whole head on rank 0 alone).

What these figures are: a 2-core CPU machine's (the cores are shared with other work; the
load average at the start is recorded), where N ranks are N processes on 2 cores with
one torch thread each (TP=1 also on two). Tensor parallelism cannot speed a model up here: it splits
the arithmetic over cores that TP=1's two threads already use, and adds the collectives. It
is measured to show what the collectives cost and that the split is exact, not as a GPU
figure; on GPUs each rank owns its device and its memory bandwidth (benchmarks/gpu_plan.py's
plan_tensor_parallel.json for the paper's M_L).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from backoff_core.models.default_pair import load_default_pair
from backoff_core.models.kernels import use_cpu_kernels
from backoff_core.parallel.ranks import TensorParallelRunner, spec_for
from backoff_core.parallel.sharding import layout
from backoff_core.runners.factory import make_runner

OUT = Path("benchmarks/results/tensor_parallel.json")
PROMPT = 64
KS = (1, 4)  # a lone catch-up, and k-bar = 1 / (1 - b) at a backoff rate of 0.75
REPEATS = 15
# (ranks, LM head split, torch threads a rank): TP=1 on one thread and on both cores; TP=2
# does not split 9 heads / 3 KV heads (its refusal is recorded)
CONFIGS = ((1, "-", 1), (1, "-", 2), (3, "vocab", 1), (3, "rank0", 1))


def runner_for(large, tp: int, head: str, threads: int):
    if tp == 1:
        return make_runner(large, "large", None, prefix_cache=None)
    spec = spec_for(large, "large", tp, None, False, None, None)
    return TensorParallelRunner(large, replace(spec, head=head, threads=threads))


def catch_up(runner, ids: list[int], prompt: list[int], threads: int) -> tuple[float, float, torch.Tensor]:
    """One catch-up of `ids` after the prompt: (wall s, rank 0's collective s, logits [1, V])."""
    torch.set_num_threads(threads)  # rank 0 (this process) on as many threads as every other rank
    comm = getattr(runner, "comm", None)
    before = comm.seconds if comm else 0.0
    start = time.perf_counter()
    ext = runner.extend([("bench", ids)], last_only=True)[0]
    wall = time.perf_counter() - start
    runner.crop("bench", len(prompt))  # the next one reads the same cache
    return wall, (comm.seconds - before) if comm else 0.0, ext.logits.clone()


def measure(runners: list, prompt: list[int]) -> list[dict]:
    """Per configuration and k: the median catch-up, rank 0's collective share, and the largest
    |logits - TP=1's|. The configurations take turns, repeat by repeat, so that a change in
    the machine's load falls on all of them alike."""
    for runner in runners:
        runner.open("bench")
        runner.extend([("bench", prompt)])
    rows = []
    for k in KS:
        ids = [(17 * i) % 40000 + 100 for i in range(k)]
        runs = [
            [catch_up(r, ids, prompt, c[2]) for r, c in zip(runners, CONFIGS)]
            for _ in tqdm(range(REPEATS), desc=f"k={k}")
        ]
        for i, (tp, head, threads) in enumerate(CONFIGS):
            walls = [run[i][0] for run in runs]
            shares = [run[i][1] / run[i][0] for run in runs]
            diff = max((run[i][2] - run[0][2]).abs().max().item() for run in runs)
            assert diff < 1e-4, (tp, head, k, diff)
            rows.append(
                {
                    "tensor_parallel": tp,
                    "head": head,
                    "threads_per_rank": threads,
                    "k": k,
                    "median_ms": round(1000 * statistics.median(walls), 2),
                    "collective_share": round(statistics.median(shares), 3),
                    "max_abs_diff_vs_tp1": diff,
                }
            )
    return rows


def refusal(large, tp: int) -> str:
    try:
        layout(large.config, "large", tp)
    except ValueError as exc:
        return str(exc)
    return ""


def main() -> None:
    load = os.getloadavg()[0]
    _, large, _ = load_default_pair()
    large = use_cpu_kernels(large)
    prompt = [(31 * i) % 40000 + 100 for i in range(PROMPT)]
    runners = [runner_for(large, tp, head, threads) for tp, head, threads in tqdm(CONFIGS, desc="start ranks")]
    results = measure(runners, prompt)
    for runner in runners:
        getattr(runner, "shutdown", lambda: None)()
    out = {
        "machine": f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), no GPU: "
        "N ranks are N processes sharing these cores",
        "load_average_at_start": round(load, 2),
        "load_average_at_end": round(os.getloadavg()[0], 2),
        "model": "default pair's M_L (SmolLM2-135M: 30 layers, 9 heads, 3 KV heads), fp32 on oneDNN kernels",
        "prompt_tokens": PROMPT,
        "repeats": REPEATS,
        "collective": "gloo (torch.distributed), loopback",
        "results": results,
        "refused": {"2": refusal(large, 2)},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    plot(out, OUT.with_suffix(".png"))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(KS), figsize=(4 * len(KS), 3.2), sharey=True)
    for ax, k in zip(axes, KS):
        rows = [r for r in out["results"] if r["k"] == k]
        labels = [
            f"TP={r['tensor_parallel']}\n{r['threads_per_rank']} thr" + (f"\n{r['head']}" if r["head"] != "-" else "")
            for r in rows
        ]
        total = [r["median_ms"] for r in rows]
        comm = [r["median_ms"] * r["collective_share"] for r in rows]
        ax.bar(labels, total, color="#9ab", label="compute")
        ax.bar(labels, comm, color="#c54", label="collectives (rank 0)")
        ax.set_title(f"catch-up of k={k}")
        ax.set_ylabel("median ms")
    axes[0].legend(fontsize=8)
    fig.suptitle("default pair's M_L, 2-core CPU (gloo)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
