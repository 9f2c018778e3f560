"""Prefix-aware routing vs power of two choices, served: where a chat-like mix of requests lands.

    python benchmarks/prefix_routing.py                     # 8 system prompts, 64 requests, 8 at once
    python benchmarks/prefix_routing.py --requests 256 --concurrency 16

The Serve app with the tiny pair (routing does not depend on the models) and 2 SmallModel
replicas, once with `prefix_routing.enabled: true` and once with false, each on a Ray of its
own. The same seeded mix both times: every request is a chat whose system prompt is one of 8
(paragraphs of Python's reference text, ~300-1000 characters, popularity ~ 1/rank) plus a short
user turn, sent over HTTP with `concurrency` in flight. Where each request ran comes back from
the replicas' info().recent (request ids, in the order they arrived).
Per mode: the share of requests that went to a replica that had already served their system
prompt (its prefix cache may hold it; the first request of each prompt can never hit: the
ceiling is 1 - prompts / requests), the system-prompt prefills that implies (misses), requests
per replica, request latency, and the prefix tree's match round trip (one blocking actor call
per request in the Ingress). Prints a table; saves benchmarks/results/prefix_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support: the tiny pair and the served-app harness

from tests.support.served_app import running_app  # noqa: E402

TOPICS = ["assignment", "calls", "class", "exceptions", "for", "function", "import", "with"]
QUESTIONS = ["Explain this.", "Give an example.", "What is a common mistake?", "Summarise it.", "Why?"]


def system_prompts(n: int) -> list[str]:
    """n system prompts: the opening of a reference topic each (no downloads: pydoc_data)."""
    from pydoc_data.topics import topics

    return [f"You are a Python tutor. Reference:\n{topics[t][:900]}" for t in TOPICS[:n]]


def workload(n_prompts: int, n_requests: int, seed: int) -> list[tuple[int, str]]:
    """(system prompt index, user turn) per request; popularity ~ 1/rank (a few hot prompts)."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(n_prompts)]
    return [(rng.choices(range(n_prompts), weights)[0], rng.choice(QUESTIONS)) for _ in range(n_requests)]


async def send(url: str, prompts: list[str], mix: list[tuple[int, str]], concurrency: int, tokens: int):
    """All requests, `concurrency` at once; (request id -> prompt index, latencies s)."""
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(mix), desc="requests", leave=False)
    ids: dict[str, int] = {}
    latencies: list[float] = []

    async def one(http: httpx.AsyncClient, k: int, question: str) -> None:
        async with gate:
            body = {
                "messages": [{"role": "system", "content": prompts[k]}, {"role": "user", "content": question}],
                "max_tokens": tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            start = time.perf_counter()
            response = await http.post("/v1/chat/completions", json=body)
            latencies.append(time.perf_counter() - start)
            response.raise_for_status()
            ids[response.json()["id"]] = k
            bar.update()

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        await asyncio.gather(*(one(http, k, q) for k, q in mix))
    bar.close()
    return ids, latencies


async def placements() -> dict[str, tuple[str, ...]]:
    """replica -> the request ids it served, in arrival order."""
    from ray import serve

    handle = serve.get_deployment_handle("SmallModel", "backoff")
    infos = await handle.broadcast("info").results_async(timeout_s=30)
    return {i.replica: i.recent for i in infos}


def match_round_trip_ms(prompts: list[str], n: int = 200) -> float | None:
    """Median round trip of the prefix tree's prefix_match, as the Ingress's router calls it."""
    import ray

    try:
        tree = ray.get_actor("LlmPrefixTreeActor", namespace="serve::backoff::SmallModel")
    except ValueError:  # routing off: no tree
        return None
    times = []
    for i in range(n):
        start = time.perf_counter()
        ray.get(tree.prefix_match.remote(prompts[i % len(prompts)], None))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run_mode(enabled: bool, args, prompts: list[str], mix: list[tuple[int, str]]) -> dict:
    def edit(config: dict, dirs) -> None:
        config["applications"][0]["args"]["prefix_routing"] = {"enabled": enabled}

    with tempfile.TemporaryDirectory() as root, running_app(Path(root), replicas={"small": 2}, edit=edit) as app:
        ids, latencies = asyncio.run(send(app.url, prompts, mix, args.concurrency, args.tokens))
        served = asyncio.run(placements())
        round_trip = match_round_trip_ms(prompts)
    hits, per_replica = 0, Counter()
    for replica, order in served.items():
        seen: set[int] = set()
        for rid in order:
            if rid in ids:
                per_replica[replica] += 1
                hits += ids[rid] in seen
                seen.add(ids[rid])
    n = len(mix)
    assert sum(per_replica.values()) == n, f"found {sum(per_replica.values())} of {n} requests on the replicas"
    return {
        "prefix_routing": enabled,
        "requests": n,
        "hit_share": hits / n,
        "system_prompt_prefills": n - hits,
        "requests_per_replica": sorted(per_replica.values(), reverse=True),
        "latency_p50_s": statistics.median(latencies),
        "latency_p90_s": sorted(latencies)[int(0.9 * n)],
        "match_round_trip_ms": round_trip,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="system prompts (at most %d)" % len(TOPICS))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens of each request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/prefix_routing.json"))
    args = ap.parse_args()
    prompts = system_prompts(args.prompts)
    mix = workload(len(prompts), args.requests, args.seed)
    runs = [run_mode(enabled, args, prompts, mix) for enabled in tqdm((True, False), desc="modes")]
    ceiling = 1 - len(set(k for k, _ in mix)) / len(mix)
    print(f"\n{len(prompts)} system prompts, {len(mix)} requests, {args.concurrency} in flight; ceiling {ceiling:.3f}")
    print(
        f"{'routing':<16}{'hit share':>10}{'prefills':>10}{'per replica':>14}{'p50 s':>8}{'p90 s':>8}{'match ms':>10}"
    )
    for r in runs:
        name = "prefix affinity" if r["prefix_routing"] else "power of two"
        rt = "-" if r["match_round_trip_ms"] is None else f"{r['match_round_trip_ms']:.2f}"
        print(
            f"{name:<16}{r['hit_share']:>10.3f}{r['system_prompt_prefills']:>10}"
            f"{str(r['requests_per_replica']):>14}{r['latency_p50_s']:>8.2f}{r['latency_p90_s']:>8.2f}{rt:>10}"
        )
    out = {"config": vars(args) | {"ceiling": ceiling, "replicas": 2, "pair": "tiny"}, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
