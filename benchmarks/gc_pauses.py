"""The garbage collector's pauses in the step loop, with the startup heap frozen and not.

    python benchmarks/gc_pauses.py     # 64 streams, 512 tokens, logprobs 5 and plain

A serving replica's process holds ~0.5 M tracked objects before it serves a token (torch,
transformers, Ray Serve, FastAPI, pydantic: this script imports the same stack), and a full
collection walks all of them with the GIL held, so every stream waits
(backoff_core/engine/gc_heap.py). Ray Serve freezes that heap in every replica once it has
loaded; this measures what the freeze is worth to the step loop. It runs the step loop of
step_overhead.py (tiny pair, static KV, forwards replayed: the host's work alone) at 64
streams, random b=0.9 with the default batched catch-ups, sampled at temperature 0.8
(penalty_overhead.run, on the wall clock): once plain, and once with `logprobs` 5, whose
entries live as long as their request, so they survive into the oldest generation and bring
its collections on. Each row runs in turn with
the heap as loaded, then frozen (`freeze_startup_heap`; unfrozen again after), `--pairs`
times. It reports, per run, the collections of each generation, their pauses summed and the
longest (gc.callbacks), the steps' wall time (the median, the longest, the sum), and per
pair the ratios as loaded over frozen of the steps' summed and longest times.

Saves benchmarks/results/gc_pauses.{json,png}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from backoff_core.engine.gc_heap import GCWatch, freeze_startup_heap
from benchmarks.penalty_overhead import replayed_engine, run

ROWS = {"plain": {}, "logprobs 5": {"logprobs": 5}}


def serving_heap() -> None:
    """Import what a replica's process holds besides the models (the deployments' modules pull
    in Ray Serve, FastAPI, pydantic and grpc), so that the heap a collection walks is a replica's."""
    import deployments.app  # noqa: F401 - imported for its objects


def measured(engine, args, params: dict, frozen: bool) -> dict:
    """One run of a row, the heap frozen (and unfrozen after) or as it is."""
    gc.collect()  # each run starts from the same empty young generations
    if frozen:
        freeze_startup_heap()
    tracked = len(gc.get_objects())
    watch = GCWatch()  # the run's own: the collections above are not its pauses
    try:
        steps = [ms for _, ms in run(engine, args.streams, args.prompt, args.tokens, params, 1000, time.perf_counter)]
    finally:
        after = watch.stats()
        watch.close()
        gc.unfreeze()
    return {
        "frozen": frozen,
        "objects_tracked": tracked,
        "objects_frozen": after.frozen,
        "steps": len(steps),
        "step_ms_median": statistics.median(steps),
        "step_ms_longest": max(steps),
        "steps_ms_sum": sum(steps),
        "collections": list(after.collections),
        "pause_ms": [s * 1e3 for s in after.seconds],
        "longest_pause_ms": max(after.longest_s) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=2, help="unfrozen/frozen pairs per row")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    serving_heap()
    engine = replayed_engine(args.streams, args.prompt + args.tokens)
    run(engine, 2, 8, 8, {"logprobs": 5}, 0, time.perf_counter)  # warm-up
    load = os.getloadavg()[0]
    rows: dict[str, list[dict]] = {name: [] for name in ROWS}
    plan = [(name, frozen) for name in ROWS for _ in range(args.pairs) for frozen in (False, True)]
    for name, frozen in tqdm(plan, desc="runs", unit="run"):
        rows[name].append(measured(engine, args, ROWS[name], frozen))
    print(
        f"\n{args.streams} streams, {args.tokens} tokens, random b=0.9; wall ms of the steps, collections (gen 0/1/2)"
    )
    table = {}
    for name, runs in rows.items():
        for r in runs:
            gens = "/".join(map(str, r["collections"]))
            print(
                f"{name:11s} {'frozen' if r['frozen'] else 'as is ':6s} steps {r['steps']:4d}  median "
                f"{r['step_ms_median']:6.2f}  longest {r['step_ms_longest']:7.1f}  sum {r['steps_ms_sum']:7.0f}  "
                f"collections {gens:11s} pauses {sum(r['pause_ms']):6.1f} ms (longest {r['longest_pause_ms']:.1f})"
            )
        pairs = [(a, b) for a, b in zip(runs[::2], runs[1::2])]
        table[name] = {
            "steps_sum_as_is_over_frozen": [a["steps_ms_sum"] / b["steps_ms_sum"] for a, b in pairs],
            "longest_step_as_is_over_frozen": [a["step_ms_longest"] / b["step_ms_longest"] for a, b in pairs],
            "full_collections_as_is": [a["collections"][2] for a, _ in pairs],
            "full_collections_frozen": [b["collections"][2] for _, b in pairs],
        }
        t = table[name]
        print(
            f"{name:11s} as is / frozen: steps' sum {' '.join(f'{x:.2f}x' for x in t['steps_sum_as_is_over_frozen'])}, "
            f"longest step {' '.join(f'{x:.1f}x' for x in t['longest_step_as_is_over_frozen'])}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "what": "wall ms of engine steps (forwards replayed) and the collections in them, heap as loaded vs frozen",
        "streams": args.streams,
        "prompt_tokens": args.prompt,
        "tokens": args.tokens,
        "routing": "random b=0.9, batched catch-ups, temperature 0.8",
        "runs": rows,
        "ratios": table,
        "load_average": [load, os.getloadavg()[0]],
    }
    (out / "gc_pauses.json").write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.6), sharey=True)
    for ax, (name, runs) in zip(axes, rows.items()):
        labels = [f"{'frozen' if r['frozen'] else 'as is'} {i // 2 + 1}" for i, r in enumerate(runs)]
        pauses = [sum(r["pause_ms"]) for r in runs]
        work = [r["steps_ms_sum"] - p for r, p in zip(runs, pauses)]
        ax.bar(labels, work, label="steps, less the pauses")
        ax.bar(labels, pauses, bottom=work, label="collections' pauses")
        ax.set_title(f"{name}: {args.streams} streams, {args.tokens} tokens")
        ax.tick_params(axis="x", rotation=30)
    axes[0].set_ylabel("wall ms of the steps, summed")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "gc_pauses.png", dpi=120)
    print(f"saved {out / 'gc_pauses.json'} and .png")


if __name__ == "__main__":
    main()
