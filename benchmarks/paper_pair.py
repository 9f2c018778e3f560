"""The paper's own pair at its shapes on one GPU (issue 53 item 5; docs/fp8.md): a random-weight
Llama-3.1-8B-shaped M_S and -70B-shaped M_L built in this process straight into fp8
(backoff_core/models/random_fp8.py: no bf16 copy of 70B, no files), their cost curve beside M_L
alone, with M_S in fp8 and in bf16 (M_L fp8 in both).

    bash scripts/gpu_bench.sh paper [TAG]           # on one H200: the `paper` stage runs this
    python benchmarks/paper_pair.py --shape tiny --device cpu --tokens 4 --out /tmp/p   # dry run

Measures, M_L's runner shared by both engines (one static KV, one set of graphs): c_S and P_L(k)
(cost_curve.measure_primitives), per-token seconds (cost_curve.run_engine, rows named as in
cost_curve: `random b=B` for B in RATES, `M_L alone (always-large)`, `M_S alone (always-small)`;
the bf16 M_S's rows the same names followed by `, M_S bf16`) with the realised backoff rate of each
random row, then always-large against b=0.9 at 16 streams (tok/s, frontier.measure_speed). Random
weights make routing meaningless: the random router at a rate. Parts past --deadline seconds are
skipped (the file says which). Writes OUT/paper_pair[-TAG].json:
    {"c_S_s", "P_L_s", "per_token_s", "realised_backoff", "tok_per_s_16", "weights_gib", "dtype",
     "M_L_alone_over_peak", "build_s", "load_s", "skipped", ...}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the checkout importable
from backoff_core.engine.engine import BackoffEngine
from backoff_core.evaluation.frontier import measure_speed
from backoff_core.models.random_fp8 import random_model
from backoff_core.runners.factory import make_runner
from backoff_core.types import KVSpec, RoutingParams
from benchmarks.cost_curve import measure_primitives, run_engine
from benchmarks.fused_step import read_bytes, spec_bandwidth
from benchmarks.gpu_plan import PAPER, PAPER_VOCAB, weight_bytes
from tests.support.tiny import tiny_tokenizer

RATES = (0.0, 0.5, 0.8, 0.9, 0.95)
TINY = {  # the dry run's shapes: every matrix whole 128 x 128 blocks
    "llama-3.1-8b": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=False),
    "llama-3.1-70b": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, tie_word_embeddings=False),
}  # fmt: skip
GIB = 2**30


def config(name: str, shape: str) -> LlamaConfig:
    shapes, vocab = (PAPER, PAPER_VOCAB) if shape == "paper" else (TINY, 512)
    return LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, eos_token_id=0, **shapes[name])


def fp8_read_bytes(model) -> int:
    """A one-token forward's weight bytes (fused_step.read_bytes) plus the fp8 layers' buffers."""
    return read_bytes(model) + weight_bytes(model) - sum(p.numel() * p.element_size() for p in model.parameters())


class Clock:
    def __init__(self, deadline: float) -> None:
        self.start, self.deadline, self.skipped = time.perf_counter(), deadline, []

    def left(self, part: str) -> bool:
        """Whether there is time for `part`; if not it is recorded as skipped."""
        ok = time.perf_counter() - self.start < self.deadline
        if not ok:
            self.skipped.append(part)
        return ok


def rows(engine, prompt, tokens, repeats, suffix: str, clock: Clock) -> tuple[dict, dict]:
    """per-token seconds of every row, and the realised backoff rate of the random ones."""
    per_token, realised = {}, {}
    todo = [(f"random b={b}", RoutingParams(router="random", rate=b)) for b in RATES]
    todo += [("M_L alone (always-large)", RoutingParams(router="always-large"))]
    todo += [("M_S alone (always-small)", RoutingParams(router="always-small"))]
    for name, routing in todo:
        if not clock.left(name + suffix):
            continue
        seconds, results = run_engine(engine, prompt, tokens, routing, repeats)
        per_token[name + suffix] = seconds
        if routing.router == "random":
            realised[name + suffix] = round(statistics.mean(r.backoff_rate for r in results), 4)
        print(f"{name + suffix}: {seconds * 1e3:.2f} ms/token", flush=True)
    return per_token, realised


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("paper", "tiny"), default="paper")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=64, help="tokens a row's request generates")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-budget", type=int, default=20480, help="static KV positions a model (20 slots of 1024)")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--deadline", type=float, default=480, help="seconds; parts after it are skipped")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"))
    args = p.parse_args(argv)
    clock = Clock(args.deadline)
    dtype = torch.bfloat16
    built = {}
    for key, name, quantize in (("M_L", "llama-3.1-70b", "fp8"), ("M_S fp8", "llama-3.1-8b", "fp8"),
                                ("M_S bf16", "llama-3.1-8b", "none")):  # fmt: skip
        start = time.perf_counter()
        built[key] = random_model(config(name, args.shape), args.device, dtype, quantize, seed=len(built))
        print(f"{key} ({name}, {quantize}) built in {time.perf_counter() - start:.1f} s", flush=True)
    build_s = time.perf_counter() - clock.start
    tokenizer = tiny_tokenizer(vocab=built["M_L"].config.vocab_size)
    kv = KVSpec(args.kv_budget, args.max_len, cuda_graphs=torch.device(args.device).type == "cuda")
    start = time.perf_counter()
    large = make_runner(built["M_L"], "large", kv, prefix_cache=None)
    engines = {
        suffix: BackoffEngine([make_runner(built[key], "small", kv, True, None, None), large], tokenizer,
                              hidden_size=built[key].config.hidden_size, context_window=args.max_len)
        for suffix, key in (("", "M_S fp8"), (", M_S bf16", "M_S bf16"))
    }  # fmt: skip
    load_s = time.perf_counter() - start
    prompt = [(7 * i + 3) % 500 + 1 for i in range(32)]
    report = {"shape": args.shape, "device": args.device, "build_s": round(build_s, 1), "load_s": round(load_s, 1)}
    report["weights_gib"] = {k: round(weight_bytes(m) / GIB, 3) for k, m in built.items()}
    report["dtype"] = {"M_L": "fp8", "M_S fp8": "fp8", "M_S bf16": "bfloat16"}
    report["c_S_s"], report["P_L_s"], report["per_token_s"], report["realised_backoff"] = {}, {}, {}, {}
    for suffix, engine in engines.items():
        run_engine(engine, prompt, 4, RoutingParams(router="random", rate=0.5), 1)  # warm-up
        if clock.left("primitives" + suffix):
            c_s, p_l = measure_primitives(engine, prompt, max(3, args.repeats), max_k=20 if not suffix else 1)
            report["c_S_s"]["fp8" if not suffix else "bf16"] = c_s
            if not suffix:
                report["P_L_s"] = p_l
        per_token, realised = rows(engine, prompt, args.tokens, args.repeats, suffix, clock)
        report["per_token_s"].update(per_token)
        report["realised_backoff"].update(realised)
    report["tok_per_s_16"] = {}
    for name, routing in (("always-large", RoutingParams(router="always-large")),
                          ("random b=0.9", RoutingParams(router="random", rate=0.9))):  # fmt: skip
        if clock.left(f"16 streams {name}"):
            report["tok_per_s_16"][name] = round(measure_speed(engines[""], routing, 16, args.tokens), 1)
    alone = report["per_token_s"].get("M_L alone (always-large)")
    bandwidth = spec_bandwidth(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    report["M_L_alone_over_peak"] = (
        None if alone is None or bandwidth is None else round(fp8_read_bytes(built["M_L"]) / bandwidth / alone, 3)
    )
    report["speedup_vs_M_L_alone"] = {
        k: round(alone / v, 3) for k, v in report["per_token_s"].items() if alone and k.startswith("random")
    }
    report["skipped"] = clock.skipped
    report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("paper_pair" + (f"-{args.tag}" if args.tag else "") + ".json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
