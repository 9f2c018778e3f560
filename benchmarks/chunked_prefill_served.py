"""Chunked prefill through the server: the live streams' inter-token latency, as their HTTP
clients see it, while a long prompt arrives; and the new request's time to first token.

    python benchmarks/chunked_prefill_served.py              # chunks off and 128; ~10 min on 2 CPU cores

The served twin of benchmarks/chunked_prefill.py (same workload, default pair, CPU): one local
Ray, one application per chunk size (`prefill_chunk_tokens`, the prefix cache off so every
repeat prefills the same prompt), real `/v1/completions` SSE streams over httpx. Per chunk
size and repeat: `--streams` streams (32-token prompts, `--stream-tokens` tokens each, the
random router at rate 0.5, one seed each); once every stream has `--arrive-after` tokens, a
`--prompt-tokens` prompt arrives (`--new-tokens` tokens). ITL: the gaps between a stream's
tokens as its client receives them, one SSE event each (tokens that crossed Ray in one
message count its gap once and the rest as 0; at ~5 tokens/s per stream on this CPU the
replica's message budget sends each token alone). Medians over repeats, chunk sizes interleaved; saves benchmarks/results/chunked_prefill_served.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.chunked_prefill import GOAL, _p99, _text_ids  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "chunked_prefill_served.json"


def serve_config(chunks: list[int], http_port: int, threads: int) -> dict:
    """One application per chunk size (`chunk-<C>` at /chunk-<C>), the default pair on CPU."""
    from deployments import harness

    config = harness.loopback_config(None, None, http_port, harness.free_port(), threads=threads)
    config.pop("grpc_options")
    base = config["applications"][0]
    base["args"]["models"]["prefix_cache_tokens"] = 0
    apps = []
    for chunk in chunks:
        app = json.loads(json.dumps(base))
        app.update(name=f"chunk-{chunk}", route_prefix=f"/chunk-{chunk}")
        app["args"]["prefill_chunk_tokens"] = chunk
        apps.append(app)
    config["applications"] = apps
    return config


async def _stream(client: httpx.AsyncClient, prompt, max_tokens: int, seed: int, got: list[float]) -> list[float]:
    """Stream one completion; append each token's arrival time to `got` (as it comes)."""
    body = {
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "seed": seed,
        "router": "random",
        "thresholds": [0.5],
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):  # the last chunk: the request's usage, no token
                continue
            if chunk["choices"] and chunk["choices"][0].get("backoff"):  # one token event
                got.append(time.perf_counter())
    return got


async def one_run(url: str, streams, prompt, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        arrivals: list[list[float]] = [[] for _ in streams]
        tasks = [
            asyncio.create_task(_stream(client, p, args.stream_tokens, i, arrivals[i])) for i, p in enumerate(streams)
        ]
        while min(len(a) for a in arrivals) < args.arrive_after:
            await asyncio.sleep(0.005)
        submitted, first = time.perf_counter(), []
        new = asyncio.create_task(_stream(client, prompt, args.new_tokens, 99, first))
        while not first and not new.done():
            await asyncio.sleep(0.005)
        ttft = (first[0] if first else time.perf_counter()) - submitted
        await asyncio.gather(new, *tasks)
    itl = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    median = statistics.median(itl)
    return {
        "itl_median_ms": 1e3 * median,
        "itl_p99_ms": 1e3 * _p99(itl),
        "itl_max_ms": 1e3 * max(itl),
        "itl_p99_over_median": _p99(itl) / median,
        "ttft_s": ttft,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 128], help="0: chunking off")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-prompt-tokens", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--arrive-after", type=int, default=4, help="tokens every stream has when the prompt comes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import ray
    from ray import serve

    from backoff_core.models.default_pair import load_default_large
    from deployments import harness, serve_cli

    _, tok = load_default_large()  # its tokenizer (the converted pair is cached after a first load)
    streams = [_text_ids(tok, args.stream_prompt_tokens, skip=i) for i in range(args.streams)]
    prompt = _text_ids(tok, args.prompt_tokens, skip=args.streams)
    port = harness.free_port()
    load = os.getloadavg()[0]
    serve_cli.start_ray(include_dashboard=False, log_to_driver=False)
    runs: dict[int, list[dict]] = {c: [] for c in args.chunks}
    try:
        serve_cli.run_config(serve_config(args.chunks, port, args.threads), blocking=False)
        for chunk in args.chunks:
            harness.wait_until_running(f"chunk-{chunk}", timeout_s=900)
            url = f"http://127.0.0.1:{port}/chunk-{chunk}"
            asyncio.run(
                one_run(url, streams[:1], streams[1][:8], argparse.Namespace(**{**vars(args), "arrive_after": 1}))
            )
        with tqdm(total=args.repeats * len(args.chunks), desc="runs") as bar:
            for _ in range(args.repeats):
                for chunk in args.chunks:
                    url = f"http://127.0.0.1:{port}/chunk-{chunk}"
                    runs[chunk].append(asyncio.run(one_run(url, streams, prompt, args)))
                    bar.update()
    finally:
        serve.shutdown()
        ray.shutdown()

    def summary(rs: list[dict]) -> dict:
        out = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        out["per_repeat_itl_p99_over_median"] = [r["itl_p99_over_median"] for r in rs]
        return out

    by_chunk = {str(c): summary(rs) for c, rs in runs.items()}
    result = {
        "command": "python benchmarks/chunked_prefill_served.py " + " ".join(sys.argv[1:]),
        "setup": {
            "pair": "default (embedded SmolLM2-135M pair), fp32, CPU; one SmallModel and one LargeModel replica "
            "per application, prefix cache off",
            "client": "httpx, /v1/completions SSE, token arrival times as the client sees them",
            **{k: v for k, v in vars(args).items() if k != "out"},
            "load_average_at_start": load,
            "load_average_at_end": os.getloadavg()[0],
        },
        "goal_itl_p99_over_median": GOAL,
        "by_chunk": by_chunk,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'chunk':>6} {'ITL median ms':>14} {'p99 ms':>8} {'p99/median':>11} {'TTFT s':>8}")
    for c, s in by_chunk.items():
        print(
            f"{c if c != '0' else 'off':>6} {s['itl_median_ms']:>14.1f} {s['itl_p99_ms']:>8.1f} "
            f"{s['itl_p99_over_median']:>11.2f} {s['ttft_s']:>8.2f}"
        )
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
