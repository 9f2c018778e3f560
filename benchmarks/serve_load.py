"""HTTP load on the Serve app at 1, 4, 16 concurrent streams, against the in-process engine.

    python benchmarks/serve_load.py --pair smollm-skip          # SmolLM2-135M + a 2-layer copy
    python benchmarks/serve_load.py --small DIR --large DIR     # any pair of saved models
    python benchmarks/serve_load.py --pair tiny --tokens 32     # seconds: tiny random models

Per stream count: aggregate tokens/s, time to first token, inter-token p50/p99, and large
forward passes per committed large token -- for the served app with batched catch-up, the
same app with batching switched off (`batching: false` in the LargeModel's user_config), the
same app with its catch-ups in flight (`overlap_catch_ups: true`, `catch_up_wait_ms: 0`: the
SmallModel steps on while the LargeModel replica catches up), and the in-process
BackoffEngine, interleaved and repeated (median kept). Every run uses the `random` router with threshold = the backoff
rate and the same per-stream seeds, so all three make exactly the same routing decisions.
Prints a table; saves benchmarks/results/serve_load[-TAG].{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
import yaml
from tqdm import tqdm

from backoff_core.engine.engine import BackoffEngine
from backoff_core.models.loading import LoadSpec, load_chain
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.pairs import PROMPTS, prepare_pair  # noqa: E402


@dataclass(frozen=True)
class RunStats:
    mode: str  # served-batched, served-unbatched, served-in-flight, in-process
    streams: int
    tokens: int
    large_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50_s: float
    itl_p50_s: float
    itl_p99_s: float
    large_forwards: int
    forwards_per_large_token: float
    sessions_per_forward: float  # catch-up calls merged into one large forward, on average
    backoff_rate: float


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _stats(mode, streams, ttfts, gaps, tokens, large_tokens, large_calls, seconds, forwards) -> RunStats:
    return RunStats(
        mode,
        streams,
        tokens,
        large_tokens,
        seconds,
        tokens / seconds,
        statistics.median(ttfts),
        _pct(gaps, 0.5),
        _pct(gaps, 0.99),
        forwards,
        forwards / max(1, large_tokens),
        large_calls / max(1, forwards),
        1 - large_tokens / max(1, tokens),
    )


def requests_for(tokenizer, streams: int, args) -> list[GenerationRequest]:
    out = []
    for i in range(streams):
        ids = tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] if args.pair != "tiny" else [3 + i % 40, 7, 11]
        out.append(
            GenerationRequest(
                tuple(ids),
                SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=i),
                RoutingParams(router="random", thresholds=(args.backoff,)),
            )
        )
    return out


# -- in process ------------------------------------------------------------------------------


def run_in_process(engine: BackoffEngine, requests: list[GenerationRequest]) -> RunStats:
    large = engine.models[-1]
    before = large.forward_passes
    start = time.perf_counter()
    rids = [engine.submit(r) for r in requests]
    last = {request_id: start for request_id in rids}
    ttfts, gaps = [], []
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter()
        for request_id, _ in events.items():
            (gaps if last[request_id] != start else ttfts).append(now - last[request_id])
            last[request_id] = now
    seconds = time.perf_counter() - start
    results = [engine.finish(request_id) for request_id in rids]
    tokens = sum(len(r.token_ids) for r in results)
    large_tokens = sum(r.tokens_by_source()[-1] for r in results)
    return _stats(
        "in-process",
        len(requests),
        ttfts,
        gaps,
        tokens,
        large_tokens,
        sum(r.large_calls for r in results),
        seconds,
        large.forward_passes - before,
    )


# -- served ----------------------------------------------------------------------------------


def serve_config(small, large, port: int, threads: int, gap_ms: float | None = None) -> dict:
    """Three applications on the same cluster, the same models: catch-up batching on and off,
    and catch-ups in flight (APPS)."""
    from deployments import serve_cli

    config = yaml.safe_load(serve_cli.DEFAULT_CONFIG.read_text())
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    config.pop("grpc_options")
    base = config["applications"][0]
    base["args"]["models"].update(small=small, large=large, device="cpu")
    base["args"]["torch_threads"] = threads
    for part in ("small", "large", "ingress"):
        base["args"][part].update(num_replicas=1, num_cpus=0)
    apps = []
    for name, (batching, overlap) in APPS.items():
        app = json.loads(json.dumps(base))
        app.update(name=name, route_prefix=f"/{name}")
        if overlap:
            app["args"].update(overlap_catch_ups=True, catch_up_wait_ms=0)
        for d in app["deployments"]:
            if d["name"] == "LargeModel":
                d["user_config"]["batching"] = batching
                if gap_ms is not None:
                    d["user_config"]["batch_gap_ms"] = gap_ms
        apps.append(app)
    config["applications"] = apps
    return config


APPS = {  # name -> (the LargeModel's catch-up batching, the SmallModel's overlap_catch_ups)
    "batched": (True, False),
    "unbatched": (False, False),
    "in-flight": (True, True),
}


async def _one_stream(client: httpx.AsyncClient, request: GenerationRequest, t0: float):
    body = {
        "prompt": list(request.prompt_ids),
        "max_tokens": request.sampling.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "seed": request.sampling.seed,
        "router": "random",
        "thresholds": list(request.routing.thresholds),
        "stream": True,
        "stream_options": {"include_usage": True},  # the usage: one last chunk, no choice (OpenAI's rule)
    }
    times, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"][0].get("backoff"):
                times.append(time.perf_counter())
    ttft = times[0] - t0
    return ttft, [b - a for a, b in zip(times, times[1:])], usage


async def _streams(url: str, requests: list[GenerationRequest]):
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        outs = await asyncio.gather(*[_one_stream(client, r, start) for r in requests])
        return outs, time.perf_counter() - start


def run_served(url: str, requests: list[GenerationRequest], mode: str, large_forwards) -> RunStats:
    before = large_forwards()
    outs, seconds = asyncio.run(_streams(url, requests))
    tokens = sum(u["completion_tokens"] for _, _, u in outs)
    large_tokens = sum(u["large_tokens"] for _, _, u in outs)
    return _stats(
        mode,
        len(requests),
        [t for t, _, _ in outs],
        [g for _, gs, _ in outs for g in gs],
        tokens,
        large_tokens,
        sum(u["large_calls"] for _, _, u in outs),
        seconds,
        large_forwards() - before,
    )


# -- report ----------------------------------------------------------------------------------


def print_table(rows: list[RunStats]) -> None:
    print(
        f"\n{'mode':18} {'streams':>7} {'tok/s':>8} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'L fwd':>6} {'fwd/L tok':>9} {'sess/fwd':>8} {'backoff':>7}"
    )
    for r in rows:
        print(
            f"{r.mode:18} {r.streams:7d} {r.tokens_per_s:8.1f} {r.ttft_p50_s * 1e3:7.0f}ms {r.itl_p50_s * 1e3:6.1f}ms "
            f"{r.itl_p99_s * 1e3:6.1f}ms {r.large_forwards:6d} {r.forwards_per_large_token:9.2f} "
            f"{r.sessions_per_forward:8.2f} {r.backoff_rate:7.2f}"
        )


def summary(rows: list[RunStats], runs: dict[tuple[str, int], list[RunStats]] | None = None) -> dict:
    """Ratios of the median rows; with `runs` (every repetition, in order) also the served /
    in-process ratio of each repetition at the fewest streams -- the two ran back to back,
    so a drift in the machine's load cancels out -- as median, min and max."""
    by = {(r.mode, r.streams): r for r in rows}
    lo, hi = min(r.streams for r in rows), max(r.streams for r in rows)
    out = {}
    if ("served-batched", lo) in by and ("in-process", lo) in by:
        out["single_stream_vs_in_process"] = by["served-batched", lo].tokens_per_s / by["in-process", lo].tokens_per_s
        if runs:
            paired = sorted(
                s.tokens_per_s / i.tokens_per_s for s, i in zip(runs["served-batched", lo], runs["in-process", lo])
            )
            out["single_stream_vs_in_process_paired"] = {
                "median": statistics.median(paired),
                "min": paired[0],
                "max": paired[-1],
                "repeats": len(paired),
            }
    if ("served-unbatched", hi) in by and ("served-batched", hi) in by:
        out["unbatched_over_batched_forwards"] = by["served-unbatched", hi].large_forwards / max(
            1, by["served-batched", hi].large_forwards
        )
    if ("served-in-flight", hi) in by and ("served-batched", hi) in by:
        out["in_flight_over_batched_tok_per_s"] = by["served-in-flight", hi].tokens_per_s / max(
            1e-9, by["served-batched", hi].tokens_per_s
        )
    for mode in ("served-batched", "served-in-flight", "in-process"):
        if (mode, lo) in by and (mode, hi) in by:
            out[f"scaling_{lo}_to_{hi}_{mode}"] = by[mode, hi].tokens_per_s / by[mode, lo].tokens_per_s
    return out


def plot(rows: list[RunStats], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ("served-batched", "served-unbatched", "served-in-flight", "in-process"):
        rs = sorted((r for r in rows if r.mode == mode), key=lambda r: r.streams)
        if rs:
            a.plot([r.streams for r in rs], [r.tokens_per_s for r in rs], "o-", label=mode)
            b.plot([r.streams for r in rs], [r.forwards_per_large_token for r in rs], "o-", label=mode)
    for ax, title in ((a, "aggregate tokens/s"), (b, "large forward passes per large token")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("smollm-skip", "default", "tiny"), default="smollm-skip")
    ap.add_argument("--small", help="M_S directory (with --large: overrides --pair)")
    ap.add_argument("--large", help="M_L directory")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=32, help="tokens per stream")
    ap.add_argument("--repeats", type=int, default=3, help="runs per (mode, streams); the median is reported")
    ap.add_argument("--backoff", type=float, default=0.5, help="backoff rate (random router threshold)")
    # 1 by default: on a small shared CPU box, two processes whose OpenMP threads spin on the
    # same cores stall each other (10x slower); pass more where each replica has its own cores
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (replicas and in-process)")
    ap.add_argument("--batch-gap-ms", type=float, default=None, help="LargeModel batch_gap_ms (default: the config's)")
    ap.add_argument("--models-dir", default="runs/serve_load")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    small, large = (args.small, args.large) if args.small else prepare_pair(args.pair, Path(args.models_dir))
    chain = load_chain(small, large, [], LoadSpec())
    engine = BackoffEngine(
        [ModelRunner(chain.models[0], "small"), ModelRunner(chain.models[-1], "large")],
        chain.tokenizer,
        context_window=chain.context_window,
    )
    engine.generate(requests_for(chain.tokenizer, 1, args)[0])  # warm-up

    import ray
    from ray import serve

    from deployments import harness, serve_cli

    port = harness.free_port()
    serve_cli.start_ray(include_dashboard=False, log_to_driver=False)
    runs: dict[tuple[str, int], list[RunStats]] = {}
    try:
        serve_cli.run_config(serve_config(small, large, port, args.threads, args.batch_gap_ms), blocking=False)
        served = {}
        for app in APPS:
            harness.wait_until_running(app)
            handle = serve.get_deployment_handle("LargeModel", app)
            served[f"served-{app}"] = (
                f"http://127.0.0.1:{port}/{app}",
                lambda h=handle: h.info.remote().result().forward_passes,
            )
        for url, forwards in served.values():
            run_served(url, requests_for(chain.tokenizer, 1, args), "warm-up", forwards)
        # interleaved and repeated: the box is shared, its load drifts; the median run is kept
        for n in tqdm(args.streams, desc="streams"):
            for _ in range(args.repeats):
                requests = requests_for(chain.tokenizer, n, args)
                runs.setdefault(("in-process", n), []).append(run_in_process(engine, requests))
                for mode, (url, forwards) in served.items():
                    runs.setdefault((mode, n), []).append(run_served(url, requests, mode, forwards))
    finally:
        serve.shutdown()
        ray.shutdown()
    rows = [sorted(rs, key=lambda r: r.tokens_per_s)[len(rs) // 2] for rs in runs.values()]
    rows.sort(key=lambda r: (r.mode, r.streams))

    print_table(rows)
    result = {
        "args": vars(args),
        "models": [small or "default-small", large or "default-large"],
        "rows": [asdict(r) for r in rows],
        "summary": summary(rows, runs),
    }
    print("\n" + json.dumps(result["summary"], indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "serve_load" + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(rows, out / f"{stem}.png")
    print(f"saved {out / stem}.json and .png")


if __name__ == "__main__":
    main()
