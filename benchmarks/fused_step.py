"""Both models against the GPU's limits: the compiled decoder layers (KVSpec.compile "on",
runners/static_compiled.py) beside the eager static forward ("off"), in one run.

    python3 benchmarks/fused_step.py --small /tmp/pair/small --large /tmp/pair/large --device cuda \
        --dtype bfloat16 --kv-budget 65536 --max-len 1024 --tag h200 --deadline 540

For each mode (compiled first): one engine over the same loaded pair (its load, graphs and
compiles timed), then
  1. replays: M_S's step graph at 1 and 64 rows over 256 and 1024 keys and M_L's one-token
     graph at 1 row (median of 50 CUDA-event timings), each with a torch.profiler kernel table
     (kernels a replay, their summed time, those under 5 us, the top kernels);
  2. each model's logits after a prompt against HF's own forward (relative error);
  3. engine rows (batch_scaling.throughput): always-large, random b=0.9 launched ahead (what
     `backoff serve` runs on CUDA), random b=0.9 and always-small, at n = 1 (--repeats-one,
     16) and at 16 and 64 streams (--repeats), each with its realised routed share.
Then the goals: c_S, M_L alone over the card's spec HBM bandwidth (its weights' bytes read a
token / bandwidth / time a token), b=0.9 over always-large at 1, 16 and 64 streams, and
measured/ideal against the bandwidth floor. Saved after every part to
benchmarks/results/gpu/fused_step[-TAG].json; with --deadline (seconds from the start) a
part that would start past it is skipped and named in "skipped" (the first mode's load,
replays and logits always run: `gpu_bench.sh all` runs them alone, FUSED_DEADLINE 60).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the packages importable
from backoff_core.engine.engine import CATCH_UP_WAIT_MS, BackoffEngine  # noqa: E402
from backoff_core.models.loading import LoadSpec, load_chain  # noqa: E402
from backoff_core.models.prompts import encode_prompt  # noqa: E402
from backoff_core.runners.graph_plan import GraphKey  # noqa: E402
from backoff_core.types import KVSpec, RoutingParams  # noqa: E402
from benchmarks.batch_scaling import PROMPT, throughput  # noqa: E402
from benchmarks.pair_args import pair_args  # noqa: E402

# the cards' spec HBM bandwidth, bytes/s (SXM parts), by the name torch reports
SPEC_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}
SMALL_KERNEL_US = 5.0
ROWS = {
    "always-large": RoutingParams(router="always-large"),
    "random b=0.9, launched ahead": RoutingParams(router="random", rate=0.9),
    "random b=0.9": RoutingParams(router="random", rate=0.9),
    "always-small": RoutingParams(router="always-small"),
}


def spec_bandwidth(name: str | None) -> float | None:
    return next((bw for card, bw in SPEC_BANDWIDTH.items() if name and card in name), None)


def read_bytes(model) -> int:
    """Bytes of weights a one-token forward reads: every parameter but the embedding table
    (one row of it is read), unless the LM head is that table."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    return total if tied else total - embed.numel() * embed.element_size()


@torch.inference_mode()
def replay_profile(runner, key: GraphKey, repeats: int = 50) -> dict:
    """One captured graph: its median replay (CUDA events) and the kernels one replay runs."""
    graphs = runner.graphs
    ms = graphs.replay_ms(key, repeats=repeats)
    graphs._harmless(key)
    graph = graphs._graphs[key]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    graphs.positions.fill_(runner.kv.scratch)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    us = [float(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)) for e in kernels]
    by_name: dict[str, list[float]] = {}
    for e, t in zip(kernels, us):
        by_name.setdefault(e.name[:90], []).append(t)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:10]
    return {
        "rows": key.rows,
        "keys": key.length,
        "replay_ms": round(ms, 4),
        "kernels": len(kernels),
        "kernel_ms": round(sum(us) / 1e3, 4),
        "kernels_under_5us": sum(t < SMALL_KERNEL_US for t in us),
        "ms_in_kernels_under_5us": round(sum(t for t in us if t < SMALL_KERNEL_US) / 1e3, 4),
        "top": [{"kernel": n, "count": len(ts), "us": round(sum(ts), 1)} for n, ts in top],
    }


def step_key(runner, rows: int, length: int) -> GraphKey | None:
    """The one-token step graph (last logits, no hidden layer) of `rows` rows over `length`
    keys that the runner captured (the dense view where there is one)."""
    for dense in (True, False):
        key = GraphKey(dense, rows, 1, length, True, None)
        if runner.graphs is not None and key in runner.graphs:
            return key
    return None


@torch.inference_mode()
def logits_rel_err(runner, model, prompt_ids: list[int]) -> float:
    """The runner's logits after the prompt (a prefill, then one token) against HF's forward."""
    runner.open("check")
    try:
        runner.extend([("check", prompt_ids[:-1])], last_only=True)
        got = runner.extend([("check", prompt_ids[-1:])], last_only=True)[0].logits[-1].float()
    finally:
        runner.close("check")
    ids = torch.tensor([prompt_ids], device=got.device)
    ref = model(ids).logits[0, -1].float()
    return float((got - ref).norm() / ref.norm())


def compile_stats(runner) -> dict | None:
    compiled = getattr(runner._forward, "compiled", None)
    if compiled is None:
        return None
    return {"compiles": compiled.compiles, "seconds": round(compiled.compile_s, 1)}


def measure_mode(mode: str, chain, args, prompt_ids, report: dict, left) -> None:
    entry = report["modes"].setdefault(mode, {})
    save = report["save"]
    start = time.perf_counter()
    engine = BackoffEngine.from_chain(chain, kv=KVSpec(args.kv_budget, args.max_len, compile=mode))
    small, large = engine.models[0], engine.models[-1]
    entry["load_s"] = round(time.perf_counter() - start, 1)
    entry["graphs"] = {"small": len(small.graphs or ()), "large": len(large.graphs or ())}
    entry["compiled"] = {"small": compile_stats(small), "large": compile_stats(large)}
    print(f"[{mode}] loaded in {entry['load_s']} s: graphs {entry['graphs']}, compiles {entry['compiled']}")
    save()
    replays = entry.setdefault("replays", {})
    for name, runner, rows, length in (
        ("small", small, 1, 256),
        ("small", small, 1, 1024),
        ("small", small, 64, 256),
        ("small", small, 64, 1024),
        ("large", large, 1, 256),
        ("large", large, 1, 1024),
    ):
        key = step_key(runner, rows, length)
        if key is not None:
            replays[f"{name} rows={rows} keys={length}"] = r = replay_profile(runner, key)
            print(f"[{mode}] {name} rows={rows} keys={length}: {r['replay_ms']} ms, {r['kernels']} kernels")
    entry["logits_rel_err"] = {
        "small": logits_rel_err(small, chain.models[0], prompt_ids),
        "large": logits_rel_err(large, chain.models[-1], prompt_ids),
    }
    print(f"[{mode}] logits against HF: {entry['logits_rel_err']}")
    save()
    rows = entry.setdefault("rows", {})
    for streams, repeats in ((1, args.repeats_one), (16, args.repeats), (64, args.repeats)):
        for label, routing in ROWS.items():
            if not left(f"{mode}: {label} at n={streams}"):
                continue
            ahead = ", launched ahead" in label
            if str(streams) not in rows.get(label, {}):  # warm the row once (allocator, lazy inits)
                throughput(engine, prompt_ids, 2, 4, routing, 1, CATCH_UP_WAIT_MS, None, ahead)
            got = throughput(engine, prompt_ids, streams, args.tokens, routing, repeats, CATCH_UP_WAIT_MS, None, ahead)
            rows.setdefault(label, {})[str(streams)] = {k: round(v, 4) for k, v in got.items()}
            print(f"[{mode}] {label} n={streams}: {got['tok_per_s']:.0f} tok/s, routed {got['routed_share']:.3f}")
            save()
    entry["compiled_after_rows"] = {"small": compile_stats(small), "large": compile_stats(large)}
    save()
    engine.launch_ahead = False
    del engine, small, large
    gc.collect()
    torch.cuda.empty_cache()


def goals(report: dict) -> dict:
    """The issue's goals from a mode's figures (None where a figure is missing)."""
    out = {}
    bw, weights = report.get("spec_bandwidth"), report["large_read_bytes"]
    for mode, entry in report["modes"].items():
        rep, rows = entry.get("replays", {}), entry.get("rows", {})

        def tok(label, n, rows=rows):
            return rows.get(label, {}).get(str(n), {}).get("tok_per_s")

        def ratio(a, b):
            return None if a is None or b is None else round(a / b, 3)

        large_one = tok("always-large", 1)
        best = {n: max(filter(None, (tok("random b=0.9", n), tok("random b=0.9, launched ahead", n))), default=None)
                for n in (1, 16, 64)}  # fmt: skip
        floor_ms = None if bw is None else 1e3 * weights / bw
        share = rows.get("random b=0.9", {}).get("1", {}).get("routed_share")
        small_ms = rep.get("small rows=1 keys=256", {}).get("replay_ms")
        ideal = None
        if None not in (floor_ms, share, small_ms):  # per token at the floor: c_S + share * P_L floor
            ideal = 1e3 / (small_ms + share * floor_ms)
        out[mode] = {
            "c_S_ms_1row_1024keys": rep.get("small rows=1 keys=1024", {}).get("replay_ms"),
            "c_S_ms_64rows_1024keys": rep.get("small rows=64 keys=1024", {}).get("replay_ms"),
            "M_L_alone_over_peak": None
            if large_one is None or floor_ms is None
            else round(large_one * floor_ms / 1e3, 3),
            "M_L_replay_over_peak": None
            if floor_ms is None or "large rows=1 keys=256" not in rep
            else round(floor_ms / rep["large rows=1 keys=256"]["replay_ms"], 3),
            "b09_over_M_L_alone_n1": ratio(best[1], large_one),
            "b09_over_always_large_n16": ratio(best[16], tok("always-large", 16)),
            "b09_over_always_large_n64": ratio(best[64], tok("always-large", 64)),
            "b09_tok_per_s_n1": best[1],
            "b09_over_bandwidth_ideal_n1": ratio(best[1], ideal),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_args(ap)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="repeats of a cell at 16 and 64 streams (median)")
    ap.add_argument("--repeats-one", type=int, default=16, help="repeats of a cell at one stream (median)")
    ap.add_argument("--modes", default="on,off", help="KVSpec.compile modes, in order")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from the start: later parts skipped")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="benchmarks/results/gpu")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("fused_step" + (f"-{args.tag}" if args.tag else "") + ".json")
    # plain Linear modules on the CPU too (a dry run compiles them; oneDNN's wrappers do not)
    chain = load_chain(args.small, args.large, (), LoadSpec(args.device, args.dtype, cpu_kernels="default"))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report: dict = {
        "gpu": gpu,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "kv_budget": args.kv_budget,
        "max_len": args.max_len,
        "tokens": args.tokens,
        "spec_bandwidth": spec_bandwidth(gpu),
        "large_read_bytes": read_bytes(chain.models[-1]),
        "small_read_bytes": read_bytes(chain.models[0]),
        "modes": {},
        "skipped": [],
    }

    def save() -> None:
        body = {k: v for k, v in report.items() if k != "save"} | {"goals": goals(report)}
        body["wall_s"] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(body, indent=2))

    def left(part: str) -> bool:
        if args.deadline is not None and time.perf_counter() - t0 > args.deadline:
            report["skipped"].append(part)
            return False
        return True

    report["save"] = save
    prompt_ids = list(encode_prompt(chain.tokenizer, PROMPT, chat=bool(chain.tokenizer.chat_template)))
    for i, mode in enumerate(args.modes.split(",")):
        if i == 0 or left(f"{mode}: load"):  # the first mode's load, replays and logits whatever the deadline
            measure_mode(mode, chain, args, prompt_ids, report, left)
    save()
    print(json.dumps(goals(report), indent=2))
    print(f"saved {path} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
