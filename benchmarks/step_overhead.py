"""The step loop's own host time: engine steps over a tiny model pair whose forward costs
almost nothing, so what is measured is the Python and tensor bookkeeping around it.

    python benchmarks/step_overhead.py            # n = 1, 16, 64 streams; always-small and random b=0.9

On a GPU a captured M_S step of a whole batch takes ~1-2 ms; host work per step of the same
order would halve the speed the graphs buy. Prints ms per step and per request-step for
per-session caches and for static KV, and saves benchmarks/results/step_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.factory import make_runner
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams

VOCAB = 512


def tiny_pair():
    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")
    pair = []
    for seed, hidden in ((0, 32), (1, 64)):
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            bos_token_id=None,
            eos_token_id=0,
            pad_token_id=0,
        )
        pair.append(LlamaForCausalLM(config).eval())
    return pair, tokenizer


def ms_per_step(engine, n, tokens, routing, repeats) -> float:
    times = []
    for rep in range(repeats):
        rids = [
            engine.submit(
                GenerationRequest(
                    (3, 4, 5, 6), SamplingParams(max_tokens=tokens, seed=rep * n + i, ignore_eos=True), routing
                )
            )
            for i in range(n)
        ]
        steps, start = 0, time.perf_counter()
        while engine.has_work():
            engine.step()
            steps += 1
        times.append((time.perf_counter() - start) / steps)
        for request_id in rids:
            engine.finish(request_id)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    (small, large), tokenizer = tiny_pair()
    streams = [int(n) for n in args.streams.split(",")]
    routings = {
        "always-small": RoutingParams(router="always-small"),
        "random b=0.9": RoutingParams(router="random", rate=0.9),
    }
    table = {}
    for storage, kv in (("per-session caches", None), ("static KV", KVSpec(128 * 256, 256))):
        engine = BackoffEngine(
            [make_runner(small, "small", kv, small=True), make_runner(large, "large", kv)], tokenizer
        )
        for label, routing in routings.items():
            ms_per_step(engine, 2, 4, routing, 1)  # warm-up
            table[f"{storage}, {label}"] = {
                str(n): ms_per_step(engine, n, args.tokens, routing, args.repeats) for n in streams
            }
    print(f"\n{'ms per step':36s} " + " ".join(f"{'n=' + str(n):>9s}" for n in streams) + "   us/request-step at n max")
    for name, row in table.items():
        cells = " ".join(f"{row[str(n)]:9.2f}" for n in streams)
        print(f"{name:36s} {cells}   {row[str(streams[-1])] * 1e3 / streams[-1]:.0f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"tokens": args.tokens, "repeats": args.repeats, "threads": args.threads, "ms_per_step": table}
    (out / "step_overhead.json").write_text(json.dumps(report, indent=2))
    print(f"saved {out / 'step_overhead.json'}")


if __name__ == "__main__":
    main()
