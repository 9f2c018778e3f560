"""Soak: the Serve app under a steady mixed load for minutes; memory and sessions over time.

    python benchmarks/soak.py                          # the default pair, 10 minutes
    python benchmarks/soak.py --pair tiny --minutes 3  # a quick check with tiny random models

`--workers` clients loop for `--minutes`, each on one transport and call kind (HTTP / gRPC,
streaming / unary), with random lengths; a share of the streams is dropped after a few
tokens (a disconnect: the server must free their sessions). Every `--sample-s` it records
the RSS of every replica process (psutil, pids from the deployments' info()), the sessions
held by the LargeModel replica, the SmallModel's live and admitted requests, and the
requests ok / failed / cancelled / refused (503). After the load it waits for the app to
drain (no live request, no session left).

Growth = (median over the last minute - median over the first minute after the warm-up)
/ the first median; the target is < 5 % for every RSS and the session count (or no more
sessions than live requests: with a few live requests one more is +20 %), 0 failed, and
nothing left after the drain.
Prints a table per minute; saves benchmarks/results/soak[-TAG].{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from pairs import PROMPTS, prepare_pair
from tqdm import tqdm

from clients import OverloadedError
from clients.grpc_client import AsyncBackoffGrpcClient
from clients.http_client import AsyncBackoffHTTPClient

KINDS = ("http-stream", "http-unary", "grpc-stream", "grpc-unary")
TARGET_GROWTH = 0.05


@dataclass(frozen=True)
class Sample:
    t_s: float  # since the load started
    rss_mb: dict[str, float]  # replica process -> resident memory
    sessions: int  # held by the LargeModel replica
    live: int  # requests in the SmallModel's step loop
    admitted: int  # slots of its admission gate held
    outcomes: dict[str, int]  # cumulative: ok, failed, cancelled, overloaded
    tokens: int  # cumulative generated tokens (finished requests)


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)  # the first few failures, for the report


# -- the app ---------------------------------------------------------------------------------


def soak_config(
    small: str | None, large: str | None, http_port: int, grpc_port: int, threads: int, routing: dict | None = None
) -> dict:
    """The packaged config, one replica each, on loopback (the default pair when small is None);
    `routing` replaces the SmallModel's user_config."""
    from deployments import harness

    config = harness.loopback_config(small, large, http_port, grpc_port, threads=threads)
    if routing is not None:
        app = config["applications"][0]
        {d["name"]: d for d in app["deployments"]}["SmallModel"]["user_config"] = routing
    return config


# -- load ------------------------------------------------------------------------------------


def _prompt(pair: str, rng: random.Random) -> str:
    if pair == "tiny":  # the tiny tokenizer's words
        return " ".join(f"w{rng.randrange(2, 40)}" for _ in range(rng.randrange(2, 8)))
    return rng.choice(PROMPTS)


async def _one(
    kind: str,
    http: AsyncBackoffHTTPClient,
    rpc: AsyncBackoffGrpcClient,
    prompt: str,
    max_tokens: int,
    drop_after: int | None,
    seed: int,
) -> tuple[str, int]:
    """One request: (outcome, generated tokens). drop_after: leave a stream after that many tokens."""
    fields = dict(max_tokens=max_tokens, temperature=0.8, seed=seed, ignore_eos=True)
    client = http if kind.startswith("http") else rpc
    if kind.endswith("unary"):
        return "ok", (await client.complete(prompt, **fields)).usage.completion_tokens
    seen = 0
    async with contextlib.aclosing(client.stream(prompt, **fields)) as stream:  # closing = disconnecting
        async for delta in stream:
            if delta.usage is not None:
                return "ok", delta.usage.completion_tokens
            seen += delta.token_id is not None
            if drop_after is not None and seen >= drop_after:
                return "cancelled", seen
    raise RuntimeError("the stream ended without usage")


async def worker(i: int, args, urls: tuple[str, str], tally: Tally, stop: asyncio.Event) -> None:
    rng = random.Random(1000 + i)
    kind = KINDS[i % len(KINDS)]
    async with (
        AsyncBackoffHTTPClient(urls[0], timeout=300) as http,
        AsyncBackoffGrpcClient(urls[1], application="backoff", timeout=300) as rpc,
    ):
        n = 0
        while not stop.is_set():
            max_tokens = rng.randrange(args.min_tokens, args.max_tokens + 1)
            dropped = kind.endswith("stream") and rng.random() < args.cancel_share
            drop = rng.randrange(1, max_tokens) if dropped else None
            try:
                outcome, tokens = await _one(kind, http, rpc, _prompt(args.pair, rng), max_tokens, drop, 1000 * i + n)
                tally.tokens += tokens
            except OverloadedError:
                outcome = "overloaded"
            except Exception as exc:  # noqa: BLE001 - every failure is counted and the first kept
                outcome = "failed"
                if len(tally.errors) < 20:
                    tally.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
            tally.outcomes[outcome] += 1
            n += 1
            await asyncio.sleep(rng.uniform(0, args.think_s))


# -- sampling --------------------------------------------------------------------------------


async def replica_pids() -> dict[str, int]:
    from ray import serve

    pids = {}
    for name in ("Ingress", "SmallModel", "LargeModel"):
        info = await serve.get_deployment_handle(name, "backoff").info.remote()
        pids[name] = info.pid
    return pids


async def sample(t0: float, pids: dict[str, int], tally: Tally) -> Sample:
    from ray import serve

    router = await serve.get_deployment_handle("SmallModel", "backoff").info.remote()
    large = await serve.get_deployment_handle("LargeModel", "backoff").info.remote()
    rss = {name: psutil.Process(pid).memory_info().rss / 2**20 for name, pid in pids.items()}
    return Sample(
        time.monotonic() - t0,
        rss,
        len(large.sessions),
        router.live,
        router.admitted,
        dict(tally.outcomes),
        tally.tokens,
    )


async def soak(args, urls: tuple[str, str]) -> tuple[list[Sample], Tally, Sample]:
    pids = await replica_pids()
    tally, stop = Tally(), asyncio.Event()
    t0 = time.monotonic()
    workers = [asyncio.create_task(worker(i, args, urls, tally, stop)) for i in range(args.workers)]
    samples: list[Sample] = []
    duration = args.minutes * 60
    with tqdm(total=round(duration), unit="s", desc="soak") as bar:
        while (now := time.monotonic() - t0) < duration:
            await asyncio.sleep(min(args.sample_s, duration - now))
            s = await sample(t0, pids, tally)
            samples.append(s)
            bar.update(round(s.t_s) - bar.n)
            bar.set_postfix(
                ok=s.outcomes.get("ok", 0),
                failed=s.outcomes.get("failed", 0),
                sessions=s.sessions,
                rss_mb="/".join(f"{v:.0f}" for v in s.rss_mb.values()),
            )
    stop.set()
    await asyncio.gather(*workers)
    drained = await _drain(t0, pids, tally)
    return samples, tally, drained


async def _drain(t0: float, pids: dict[str, int], tally: Tally, timeout_s: float = 30.0) -> Sample:
    """The last sample once no request is live and no session held (or after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = await sample(t0, pids, tally)
        if (s.live == 0 and s.sessions == 0) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.5)


# -- report ----------------------------------------------------------------------------------


def _median(samples: list[Sample], value) -> float:
    return statistics.median(value(s) for s in samples) if samples else float("nan")


def growth(samples: list[Sample], warmup_s: float, value) -> dict:
    """(median of the last minute - median of the first minute after warm-up) / first."""
    end = samples[-1].t_s
    first = [s for s in samples if warmup_s <= s.t_s < warmup_s + 60]
    last = [s for s in samples if s.t_s > end - 60]
    a, b = _median(first, value), _median(last, value)
    if a > 0:
        g = (b - a) / a
    else:
        g = 0.0 if b == 0 else float("inf")
    return {"first": a, "last": b, "growth": g}


def summarize(samples: list[Sample], tally: Tally, drained: Sample, warmup_s: float) -> dict:
    out = {
        "rss_mb": {name: growth(samples, warmup_s, lambda s, n=name: s.rss_mb[n]) for name in samples[0].rss_mb},
        "sessions": growth(samples, warmup_s, lambda s: s.sessions),
        "router_live": growth(samples, warmup_s, lambda s: s.live),
        "outcomes": dict(tally.outcomes),
        "tokens": tally.tokens,
        "tokens_per_s": tally.tokens / samples[-1].t_s,
        "drained": {"live": drained.live, "sessions": drained.sessions, "admitted": drained.admitted},
        "errors": tally.errors,
    }
    checks = [g["growth"] < TARGET_GROWTH for g in out["rss_mb"].values()]
    # sessions follow the live requests (a few, so one more is +20 %): growth beyond them is a leak
    sessions_ok = out["sessions"]["growth"] < TARGET_GROWTH or out["sessions"]["last"] <= out["router_live"]["last"]
    checks += [sessions_ok, tally.outcomes.get("failed", 0) == 0, drained.live == 0 and drained.sessions == 0]
    out["passed"] = all(checks)
    return out


def print_table(samples: list[Sample], summary: dict) -> None:
    names = list(samples[0].rss_mb)
    print(
        f"\n{'min':>4} {'ok':>6} {'failed':>6} {'cancel':>6} {'503':>5} {'tok/s':>6} "
        + " ".join(f"{'RSS ' + n[:11] + ' MB':>18}" for n in names)
        + f" {'sessions':>8} {'live':>5}"
    )
    previous = None
    minutes = max(1, math.ceil(samples[-1].t_s / 60 - 0.01))  # the last sample lands just after the end
    for minute in range(minutes):
        rows = [s for s in samples if minute == min(int(s.t_s // 60), minutes - 1)]
        if not rows:
            continue
        last = rows[-1]
        seconds = last.t_s - (previous.t_s if previous else 0.0)
        done = {
            k: last.outcomes.get(k, 0) - (previous.outcomes.get(k, 0) if previous else 0)
            for k in ("ok", "failed", "cancelled", "overloaded")
        }
        tok_s = (last.tokens - (previous.tokens if previous else 0)) / max(seconds, 1e-9)
        rss = " ".join(f"{_median(rows, lambda s, n=n: s.rss_mb[n]):18.1f}" for n in names)
        print(
            f"{minute:4d} {done['ok']:6d} {done['failed']:6d} {done['cancelled']:6d} {done['overloaded']:5d} "
            f"{tok_s:6.1f} {rss} {_median(rows, lambda s: s.sessions):8.1f} {_median(rows, lambda s: s.live):5.1f}"
        )
        previous = last
    print("\ngrowth, last minute vs first minute after warm-up (target < 5 %):")
    for name, g in summary["rss_mb"].items():
        print(f"  RSS {name:12} {g['first']:8.1f} -> {g['last']:8.1f} MB  {g['growth'] * 100:+6.2f} %")
    for key in ("sessions", "router_live"):
        g = summary[key]
        print(f"  {key:16} {g['first']:8.1f} -> {g['last']:8.1f}     {g['growth'] * 100:+6.2f} %")
    print(
        f"requests: {summary['outcomes']}; {summary['tokens_per_s']:.1f} tokens/s; after the load: "
        f"{summary['drained']}; {'PASSED' if summary['passed'] else 'FAILED'}"
    )
    for e in summary["errors"]:
        print("  error:", e)


def plot(samples: list[Sample], warmup_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.t_s / 60 for s in samples]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for name in samples[0].rss_mb:
        a.plot(minutes, [s.rss_mb[name] for s in samples], label=name)
    a.set_ylabel("RSS (MB)")
    b.plot(minutes, [s.sessions for s in samples], label="LargeModel sessions")
    b.plot(minutes, [s.live for s in samples], label="SmallModel live requests")
    for kind in ("ok", "failed", "cancelled", "overloaded"):
        c.plot(minutes, [s.outcomes.get(kind, 0) for s in samples], label=kind)
    c.set_ylabel("requests (cumulative)")
    for ax, title in ((a, "replica memory"), (b, "sessions and live requests"), (c, "requests")):
        ax.axvline(warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
        ax.set_xlabel("minutes")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("default", "tiny"), default="default")
    ap.add_argument("--minutes", type=float, default=10.0, help="minutes of load, warm-up included")
    ap.add_argument("--warmup-minutes", type=float, default=1.0, help="left out of the growth figures")
    ap.add_argument("--workers", type=int, default=8, help="clients in a loop (a quarter per transport and kind)")
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cancel-share", type=float, default=0.2, help="share of streams dropped early")
    ap.add_argument("--think-s", type=float, default=0.5, help="a worker pauses up to this long between requests")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--models-dir", default="runs/serve_load")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.minutes <= args.warmup_minutes + 1:
        ap.error("--minutes must exceed --warmup-minutes by more than one minute")
    small, large = prepare_pair(args.pair, Path(args.models_dir))

    import ray
    from ray import serve

    from deployments import harness, serve_cli

    http_port, grpc_port = harness.free_port(), harness.free_port()
    serve_cli.start_ray(include_dashboard=False, log_to_driver=False)
    try:
        # the tiny random models are never uncertain enough for the config's entropy threshold:
        # route them at random, half the steps to the large model, so sessions come and go
        routing = {"router": "random", "threshold": [0.5]} if args.pair == "tiny" else None
        serve_cli.run_config(soak_config(small, large, http_port, grpc_port, args.threads, routing), blocking=False)
        harness.wait_until_running("backoff")
        urls = (f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")
        samples, tally, drained = asyncio.run(soak(args, urls))
    finally:
        serve.shutdown()
        ray.shutdown()

    warmup_s = args.warmup_minutes * 60
    summary = summarize(samples, tally, drained, warmup_s)
    print_table(samples, summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "soak" + (f"-{args.tag}" if args.tag else "")
    result = {
        "args": vars(args),
        "summary": summary,
        "samples": [asdict(s) for s in samples],
        "drained": asdict(drained),
    }
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(samples, warmup_s, out / f"{stem}.png")
    print(f"saved {out / stem}.json and .png")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
