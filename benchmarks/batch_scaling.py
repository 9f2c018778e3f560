"""Aggregate throughput of many concurrent requests in one engine (batched steps), per routing.

    python benchmarks/batch_scaling.py                      # the embedded default pair, CPU
    python benchmarks/batch_scaling.py --small models/small --large models/large \
        --device cuda --dtype bfloat16 --kv-budget 262144 --max-len 1024 --tag h100

n requests of --tokens tokens each run together through `engine.generate_many` (one M_S
forward per step for all of them, one catch-up forward per level); tok/s counts generated
tokens over the wall time after admission. Every figure is a median over repeats, all in
one run. Saves benchmarks/results[/gpu]/batch_scaling[-TAG].{json,png} as
{"tok_per_s": {"<routing label>": {"<n>": value}}, ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from backoff_core.engine.engine import BackoffEngine
from backoff_core.models.loading import LoadSpec, load_chain
from backoff_core.models.prompts import encode_prompt
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams

PROMPT = "Write a short paragraph about the history of the Python programming language."
ROUTINGS = {
    "always-large": RoutingParams(router="always-large"),
    "random b=0.9": RoutingParams(router="random", rate=0.9),
    "always-small": RoutingParams(router="always-small"),
}


def throughput(engine, prompt_ids, n, tokens, routing, repeats) -> float:
    """Median tok/s of n requests generated together (admission excluded)."""
    rates = []
    for rep in range(repeats):
        reqs = [
            GenerationRequest(
                tuple(prompt_ids), SamplingParams(max_tokens=tokens, seed=rep * 1000 + i, ignore_eos=True), routing
            )
            for i in range(n)
        ]
        rids = [engine.submit(r) for r in reqs]
        _sync()
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        _sync()
        seconds = time.perf_counter() - start
        done = sum(len(engine.finish(request_id).token_ids) for request_id in rids)
        rates.append(done / seconds)
    return statistics.median(rates)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small")
    ap.add_argument("--large")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", default="1,4,16,64", help="comma-separated concurrency levels n")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-budget", type=int, default=None, help="static KV storage of this many tokens per model")
    ap.add_argument("--max-len", type=int, default=1024, help="positions per static KV slot")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=None, help="default: benchmarks/results (benchmarks/results/gpu on cuda)")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()

    chain = load_chain(args.small, args.large, (), LoadSpec(args.device, args.dtype))
    kv = KVSpec(args.kv_budget, args.max_len, not args.no_cuda_graphs) if args.kv_budget else None
    start = time.perf_counter()
    engine = BackoffEngine.from_chain(chain, kv=kv)
    load_s = time.perf_counter() - start
    prompt_ids = encode_prompt(chain.tokenizer, PROMPT, chat=bool(chain.tokenizer.chat_template))
    streams = [int(s) for s in args.streams.split(",")]
    for routing in ROUTINGS.values():  # warm-up: allocator growth, lazy initialisation
        throughput(engine, prompt_ids, 2, 4, routing, 1)
    table: dict[str, dict[str, float]] = {}
    for label, routing in tqdm(ROUTINGS.items(), desc="routings"):
        table[label] = {
            str(n): throughput(engine, prompt_ids, n, args.tokens, routing, args.repeats)
            for n in tqdm(streams, desc=label, leave=False)
        }
    base = str(streams[0])
    report = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "kv": None
        if kv is None
        else {"budget_tokens": kv.budget_tokens, "max_len": kv.max_len, "cuda_graphs": kv.cuda_graphs},
        "engine_load_s": load_s,
        "tok_per_s": table,
        "scaling_vs_n1": {label: {n: v / row[base] for n, v in row.items()} for label, row in table.items()},
    }
    _print(report, streams)
    out = Path(args.out or ("benchmarks/results/gpu" if args.device.startswith("cuda") else "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    stem = "batch_scaling" + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    _plot(report, streams, out / f"{stem}.png")
    print(f"saved {out / stem}.json and .png")


def _print(report, streams) -> None:
    print(f"\n{'routing':16s} " + " ".join(f"{'n=' + str(n):>10s}" for n in streams) + "   (tok/s; x n=1)")
    for label, row in report["tok_per_s"].items():
        cells = " ".join(f"{row[str(n)]:10.1f}" for n in streams)
        print(f"{label:16s} {cells}   x{report['scaling_vs_n1'][label][str(streams[-1])]:.1f}")


def _plot(report, streams, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, row in report["tok_per_s"].items():
        ax.plot(streams, [row[str(n)] for n in streams], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests n")
    ax.set_ylabel("aggregate tokens / s (median)")
    ax.set_title(f"Batch scaling ({report['gpu'] or report['device']}, {report['dtype']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
