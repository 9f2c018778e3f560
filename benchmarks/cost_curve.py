"""Per-token cost vs backoff rate, beside M_S alone, M_L alone, our speculative mode and HF
assisted generation, all in one run (DESIGN.md §3).

    python benchmarks/cost_curve.py                 # the embedded default pair
    python benchmarks/cost_curve.py --small DIR --large DIR --device cuda
    python benchmarks/cost_curve.py --small models/small --large models/large --device cuda \
        --dtype bfloat16 --kv-budget 65536 --max-len 1024 --tag h100   # -> results/gpu/cost_curve-h100.*

Prints a table and saves benchmarks/results/cost_curve[-TAG].{json,png}. Every figure is a
median over repeats: each engine row (one stream) over --repeats generations (16 by default,
the prompts in turn) with its realised routed share (the share of tokens a larger model gave),
the HF baselines over --hf-repeats each prompt; c_S, c_r and P_L(k) (k 1..20 and PL_LONG, one
forward each: no cliff past 16) are measured in the same run as the throughput, and the ideal
of the cost model C(b) = c_S + c_r + (1-b)·P_L(1/(1-b)) is printed beside it, and on a GPU
also the ideal at the bandwidth floor (each catch-up one read of M_L's weights at the card's
spec bandwidth) and M_L alone over the card's spec bandwidth (M_L_alone_over_peak). With
--deadline (seconds from the start) an HF baseline that would start past it is skipped and
named in "skipped".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: benchmarks importable
from backoff_core.engine.engine import BackoffEngine
from backoff_core.models.loading import LoadSpec, load_chain
from backoff_core.models.prompts import encode_prompt
from backoff_core.routing.head import ClassifierHead, HeadMeta
from backoff_core.routing.routers import Classifier, StepContext, build_router
from backoff_core.runners.dynamic import timed
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams, Verification
from benchmarks.fused_step import read_bytes, spec_bandwidth

PROMPTS = [
    "Write a short paragraph about the history of the Python programming language.",
    "Give three tips for writing readable code, with one sentence each.",
]
RATES = (0.0, 0.5, 0.8, 0.9, 0.95, 1.0)
PL_LONG = (24, 32, 33, 64, 128)  # catch-ups past the largest k bucket (16): one forward each too


def measure_primitives(engine, prompt_ids, repeats, max_k=20, long=PL_LONG):
    """c_S (one M_S token), P_L(k) (M_L over k new tokens: 1..max_k, then `long`), on a cache
    holding the prompt, through the engine's own runners (static KV + CUDA graphs where it
    has them)."""
    small, large = engine.models[0], engine.models[-1]

    def step_cost(runner, k):
        # one session holding the prompt; each probe extends by k tokens and crops back
        request_id = f"probe-{k}"
        runner.open(request_id)
        runner.extend([(request_id, prompt_ids)], last_only=True)
        times = []
        for _ in range(repeats):  # as the engine's catch-up asks: the logits after the last id
            _, seconds = timed(
                runner.extend, [(request_id, (prompt_ids * (k // len(prompt_ids) + 1))[:k])], last_only=True
            )
            runner.crop(request_id, len(prompt_ids))
            times.append(seconds)
        runner.close(request_id)
        return statistics.median(times)

    c_s = statistics.median(step_cost(small, 1) for _ in range(3))
    ks = [*range(1, max_k + 1), *long]
    p_l = {k: step_cost(large, k) for k in tqdm(ks, desc="P_L(k)", leave=False)}
    return c_s, p_l


def measure_router_costs(chain, repeats=200):
    """c_r of the entropy rule and of a classifier head (4096-wide MLP as in the paper, d->1024->2)."""
    vocab, d = chain.models[0].config.vocab_size, chain.models[0].config.hidden_size
    ctx = StepContext(torch.randn(1, vocab), torch.randn(1, d), None, torch.zeros(1), torch.rand(1))
    out = {}
    head = ClassifierHead(HeadMeta(hidden_size=d, layer=-1, inner_size=1024))
    for name, router in (
        ("entropy", build_router("entropy")),
        ("random", build_router("random", rate=0.5)),
        ("classifier", Classifier(head)),
    ):
        times = [timed(router.scores, ctx)[1] for _ in range(repeats)]
        out[name] = statistics.median(times)
    return out


def bandwidth_floors(chain) -> dict:
    """Bytes of each model's weights over the device's measured copy bandwidth (GPU only):
    the time no decode step can beat, since every step reads every weight once."""
    buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    out = torch.empty_like(buf)
    out.copy_(buf)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        _, seconds = timed(out.copy_, buf)
        times.append(seconds)
    bandwidth = 2 * buf.numel() / statistics.median(times)  # bytes read + written per second
    del buf, out
    sizes = {
        name: sum(p.numel() * p.element_size() for p in m.parameters())
        for name, m in (("M_S", chain.models[0]), ("M_L", chain.models[-1]))
    }
    return {
        "bandwidth_bytes_per_s": bandwidth,
        "weights_bytes": sizes,
        "floor_s": {name: size / bandwidth for name, size in sizes.items()},
    }


def run_engine(engine, prompts, max_tokens, routing, repeats):
    """One stream, `repeats` generations, the prompts in turn (seed i for the i-th): the median
    seconds a token (prefill excluded), the realised routed share (tokens a larger model gave,
    over every generated token) and the results."""
    per_token, results = [], []
    for i in range(repeats):
        req = GenerationRequest(
            tuple(prompts[i % len(prompts)]), SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True), routing
        )
        start = time.perf_counter()
        result = engine.generate(req)
        per_token.append((time.perf_counter() - start - result.timings.prefill) / len(result.token_ids))
        results.append(result)
    routed = sum(s > 0 for r in results for s in r.sources) / sum(len(r.sources) for r in results)
    return statistics.median(per_token), routed, results


def run_hf(model, prompt_ids, max_tokens, repeats, assistant=None, static=False):
    """static: HF's static cache, which its generate compiles (torch.compile) on a GPU."""
    ids = torch.tensor([prompt_ids], device=model.device)
    times = []
    for _ in range(repeats):
        kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        if assistant is not None:
            kwargs["assistant_model"] = assistant
        if static:
            kwargs["cache_implementation"] = "static"
        (out, seconds) = timed(model.generate, ids, **kwargs)
        times.append(seconds / (out.shape[1] - ids.shape[1]))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small")
    ap.add_argument("--large")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cpu-kernels", default="mkldnn", choices=["mkldnn", "default"])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--repeats", type=int, default=16, help="generations of an engine row (one stream), the prompts in turn"
    )
    ap.add_argument("--hf-repeats", type=int, default=3, help="generations of an HF baseline, each prompt")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from the start: later HF baselines skipped")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--kv-budget", type=int, default=None, help="static KV storage of this many tokens per model")
    ap.add_argument("--max-len", type=int, default=1024, help="positions per static KV slot")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=None, help="default: benchmarks/results (benchmarks/results/gpu on cuda)")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()

    t0 = time.perf_counter()
    chain = load_chain(args.small, args.large, (), LoadSpec(args.device, args.dtype, cpu_kernels=args.cpu_kernels))
    kv = KVSpec(args.kv_budget, args.max_len, not args.no_cuda_graphs) if args.kv_budget else None
    start = time.perf_counter()
    engine = BackoffEngine.from_chain(chain, kv=kv)
    load_s = time.perf_counter() - start
    gpu = args.device.startswith("cuda")
    prompts = [encode_prompt(chain.tokenizer, t, chat=bool(chain.tokenizer.chat_template)) for t in PROMPTS]
    prompt_ids = prompts[0]
    n, reps, hf_reps = args.max_tokens, args.repeats, args.hf_repeats

    # warm-up: first calls pay for allocator growth and lazy initialisation
    for router in ("always-large", "always-small"):
        run_engine(engine, prompts, 4, RoutingParams(router=router), 1)
    run_hf(chain.models[-1], prompt_ids, 4, 1, chain.models[0])
    c_s, p_l = measure_primitives(engine, prompt_ids, 5)
    c_r = measure_router_costs(chain)
    rows, routed, skipped = {}, {}, []
    configs = [(f"random b={b}", RoutingParams(router="random", rate=b)) for b in RATES]
    configs += [
        ("M_S alone (always-small)", RoutingParams(router="always-small")),
        ("M_L alone (always-large)", RoutingParams(router="always-large")),
        (
            f"ours speculative K={args.draft_tokens}+heuristic",
            RoutingParams(router="draft", draft_tokens=args.draft_tokens, verification=Verification.EXACT),
        ),
    ]
    spec_results = []
    for name, routing in tqdm(configs, desc="engine configs"):
        rows[name], routed[name], results = run_engine(engine, prompts, n, routing, reps)
        if routing.router == "draft":
            spec_results += results
    baselines = [("HF generate M_L", None, False), ("HF assisted (M_S drafts)", chain.models[0], False)]
    if gpu:  # compiling on a CPU takes longer than the whole benchmark
        baselines.append(("HF generate M_L (static cache + compile)", None, True))
    for name, assistant, static in tqdm(baselines, desc="HF baselines"):
        if args.deadline is not None and time.perf_counter() - t0 > args.deadline:
            skipped.append(name)
            continue
        ids = prompts
        if static:
            # torch.compile specialises on the static cache's shape (prompt + max_new_tokens):
            # one prompt only, compiled by an untimed first call of exactly the timed shape
            ids = ids[:1]
            run_hf(chain.models[-1], ids[0], n, 1, static=True)
        rows[name] = statistics.median(run_hf(chain.models[-1], i, n, hf_reps, assistant, static) for i in ids)

    floors = bandwidth_floors(chain) if gpu else None
    proposed = sum(r.sources.count(0) + r.rollbacks for r in spec_results)
    acceptance = sum(r.sources.count(0) for r in spec_results) / max(1, proposed)
    ideal = {}
    for b in RATES:
        k_bar = 1 / (1 - b) if b < 1 else None
        k = min(max(p_l), round(k_bar)) if k_bar else None
        ideal[b] = c_s + c_r["random"] + ((1 - b) * p_l[k] if k else 0.0)
    peak = spec_bandwidth(torch.cuda.get_device_name()) if gpu else None
    floor_ideal = bandwidth_ideal(c_s + c_r["random"], read_bytes(chain.models[-1]), peak, routed)
    report = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "dtype": args.dtype,
        "max_tokens": n,
        "repeats": reps,
        "hf_repeats": hf_reps,
        "engine_load_s": load_s,
        "kv": None
        if kv is None
        else {"budget_tokens": kv.budget_tokens, "max_len": kv.max_len, "cuda_graphs": kv.cuda_graphs},
        "c_S_s": c_s,
        "c_r_s": c_r,
        "P_L_s": p_l,
        "cost_ratio_P_L1_over_c_S": p_l[1] / c_s,
        "P_L17_over_P_L16": p_l[17] / p_l[16],  # ~1: a catch-up of 17 is one forward, as of 16
        "per_token_s": rows,
        "routed_share": routed,  # the realised share of tokens a larger model gave, engine rows
        "ideal_per_token_s": {f"random b={b}": v for b, v in ideal.items()},
        "measured_over_ideal_throughput": {f"random b={b}": ideal[b] / rows[f"random b={b}"] for b in RATES},
        # the ideal with every catch-up at M_L's bandwidth floor (its weights once at the card's spec
        # bandwidth), at the row's realised routed share
        "spec_bandwidth": peak,
        "ideal_at_bandwidth_floor_per_token_s": floor_ideal,
        "measured_over_bandwidth_ideal": None
        if floor_ideal is None
        else {name: floor_ideal[name] / rows[name] for name in floor_ideal},
        "speculative_acceptance_rate": acceptance,
        "bandwidth": floors,
        "M_L_alone_over_floor": rows["M_L alone (always-large)"] / floors["floor_s"]["M_L"] if floors else None,
        # the share of the card's spec HBM bandwidth M_L alone reads its weights at (fused_step's rule)
        "M_L_alone_over_peak": over_peak(read_bytes(chain.models[-1]), peak, rows["M_L alone (always-large)"]),
        "c_S_over_floor": c_s / floors["floor_s"]["M_S"] if floors else None,
        "router_overhead_vs_c_S": {k: v / c_s for k, v in c_r.items()},
        "skipped": skipped,
        "wall_s": time.perf_counter() - t0,
    }
    _print(report)
    out = Path(args.out or ("benchmarks/results/gpu" if gpu else "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    stem = "cost_curve" + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / f"{stem}.png")
    print(f"saved {out / stem}.json and .png")


def over_peak(weights_bytes: int, bandwidth: float | None, seconds_per_token: float) -> float | None:
    """Weights' bytes a token reads / the card's spec bandwidth / the measured time a token
    (None off a card with a spec bandwidth: SPEC_BANDWIDTH)."""
    return None if bandwidth is None else weights_bytes / bandwidth / seconds_per_token


def bandwidth_ideal(c_small: float, weights_bytes: int, bandwidth: float | None, routed: dict) -> dict | None:
    """Seconds a token of each random-b row would take were every catch-up at M_L's bandwidth
    floor: c_S + c_r + routed share x (M_L's weights / the spec bandwidth), at the row's
    realised share (a routed token is one catch-up at one stream)."""
    if bandwidth is None:
        return None
    floor = weights_bytes / bandwidth
    return {name: c_small + share * floor for name, share in routed.items() if name.startswith("random b=")}


def _print(r) -> None:
    base = r["per_token_s"]["M_L alone (always-large)"]
    print(
        f"\nc_S = {r['c_S_s'] * 1e3:.2f} ms   P_L(1) = {r['P_L_s'][1] * 1e3:.2f} ms   "
        f"cost ratio {r['cost_ratio_P_L1_over_c_S']:.2f}x   P_L(8) = {r['P_L_s'][8] * 1e3:.2f} ms"
    )
    print(
        "c_r: "
        + ", ".join(
            f"{k} {v * 1e3:.3f} ms ({r['router_overhead_vs_c_S'][k]:.1%} of c_S)" for k, v in r["c_r_s"].items()
        )
    )
    print(f"\n{'config':34s} {'ms/token':>9s} {'tok/s':>7s} {'vs M_L':>7s} {'ideal ms':>9s} {'meas/ideal':>10s}")
    for name, sec in r["per_token_s"].items():
        ideal = r["ideal_per_token_s"].get(name)
        extra = f"{ideal * 1e3:9.2f} {r['measured_over_ideal_throughput'][name]:10.2f}" if ideal else ""
        print(f"{name:34s} {sec * 1e3:9.2f} {1 / sec:7.1f} {base / sec:6.2f}x {extra}")
    print(f"\nour speculative mode: acceptance rate {r['speculative_acceptance_rate']:.2f}")
    print(
        f"P_L(17) / P_L(16) {r['P_L17_over_P_L16']:.2f}; routed share: "
        + ", ".join(f"{name} {share:.3f}" for name, share in r["routed_share"].items() if name.startswith("random"))
    )
    if r["M_L_alone_over_peak"] is not None:
        over = r["measured_over_bandwidth_ideal"]
        print(
            f"M_L alone at {r['M_L_alone_over_peak']:.0%} of the card's spec bandwidth; measured / ideal at "
            "the bandwidth floor: " + ", ".join(f"{name} {v:.2f}" for name, v in over.items())
        )
    if r["skipped"]:
        print(f"skipped past the deadline: {', '.join(r['skipped'])}")
    if r["bandwidth"]:
        f = r["bandwidth"]
        print(
            f"bandwidth {f['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; floors: M_S {f['floor_s']['M_S'] * 1e3:.3f} ms, "
            f"M_L {f['floor_s']['M_L'] * 1e3:.2f} ms; M_L alone / floor {r['M_L_alone_over_floor']:.2f}, "
            f"c_S / floor {r['c_S_over_floor']:.1f}"
        )


def _plot(r, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    bs = list(RATES)
    ax.plot(bs, [r["per_token_s"][f"random b={b}"] * 1e3 for b in bs], "o-", label="backoff (random router), measured")
    ax.plot(bs, [r["ideal_per_token_s"][f"random b={b}"] * 1e3 for b in bs], "--", label="cost model C(b)")
    styles = {
        "M_S alone (always-small)": ":",
        "M_L alone (always-large)": "-.",
        "HF generate M_L": (0, (1, 3)),
        "HF assisted (M_S drafts)": (0, (5, 2)),
    }
    for name, style in styles.items():
        if name not in r["per_token_s"]:  # an HF baseline skipped past the deadline
            continue
        ax.axhline(r["per_token_s"][name] * 1e3, linestyle=style, color="grey", label=name)
    spec = next(k for k in r["per_token_s"] if k.startswith("ours speculative"))
    ax.axhline(r["per_token_s"][spec] * 1e3, color="tab:green", label=spec)
    ax.set_xlabel("backoff rate b (share of tokens from M_S)")
    ax.set_ylabel("ms per generated token (median)")
    ax.set_title(f"Per-token cost vs backoff rate ({r['device']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
