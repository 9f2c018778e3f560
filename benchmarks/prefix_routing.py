"""Prefix-aware routing vs power of two choices, served: where a chat-like mix of requests lands.

    python benchmarks/prefix_routing.py                     # 8 system prompts, 64 requests, 8 at once, 3 rounds
    python benchmarks/prefix_routing.py --max-imbalance 2 --concurrency 16

The Serve app with the tiny pair (routing does not depend on the models) and 2 SmallModel
replicas, deployed twice on one Ray: `affinity` (prefix_routing on, `--max-imbalance`) and
`pow2` (off). Each round sends the same seeded mix to both, in alternating order (the box's
load drifts): every request a chat whose system prompt is one of 8 (the opening 900 characters
of a Python reference topic, new ones each round; popularity ~ 1/rank) plus a short user turn,
over HTTP with `concurrency` in flight. Where each request ran comes back from the replicas'
info().recent (request ids, in the order they arrived).
Per mode: the share of requests that went to a replica that had already served their system
prompt (its prefix cache may hold it; the first request of each prompt can never hit: the
ceiling is 1 - prompts / requests), the system-prompt prefills that implies (misses), requests
per replica, request latency, and the prefix tree's match round trip (one actor call
per request in the Ingress). Prints a table; saves benchmarks/results/prefix_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
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

MODES = {"affinity": True, "pow2": False}  # application name -> prefix_routing.enabled
QUESTIONS = ["Explain this.", "Give an example.", "What is a common mistake?", "Summarise it.", "Why?"]
PROMPT_CHARS = 900


def system_prompts(n: int, round_: int) -> list[str]:
    """Round `round_`'s n system prompts: the opening of a reference topic each (pydoc_data)."""
    from pydoc_data.topics import topics

    long = [t for t in sorted(topics) if len(topics[t]) >= PROMPT_CHARS]
    chosen = long[n * round_ : n * (round_ + 1)]
    assert len(chosen) == n, f"not enough reference topics for round {round_}"
    return [f"You are a Python tutor. Reference:\n{topics[t][:PROMPT_CHARS]}" for t in chosen]


def workload(n_prompts: int, n_requests: int, seed: int) -> list[tuple[int, str]]:
    """(system prompt index, user turn) per request; popularity ~ 1/rank (a few hot prompts)."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(n_prompts)]
    return [(rng.choices(range(n_prompts), weights)[0], rng.choice(QUESTIONS)) for _ in range(n_requests)]


async def send(url: str, prompts: list[str], mix: list[tuple[int, str]], concurrency: int, tokens: int):
    """All requests, `concurrency` at once; (request id -> system prompt, latencies s)."""
    gate = asyncio.Semaphore(concurrency)
    ids: dict[str, str] = {}
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
            ids[response.json()["id"]] = prompts[k]

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        await asyncio.gather(*(one(http, k, q) for k, q in mix))
    return ids, latencies


async def placements(app: str) -> dict[str, tuple[str, ...]]:
    """replica -> the request ids it served, in arrival order."""
    from ray import serve

    handle = serve.get_deployment_handle("SmallModel", app)
    infos = await handle.broadcast("info").results_async(timeout_s=30)
    return {i.replica: i.recent for i in infos}


def match_round_trip_ms(app: str, prompts: list[str], n: int = 200) -> float:
    """Median round trip of the prefix tree's prefix_match, as the Ingress's router calls it."""
    import ray

    tree = ray.get_actor("LlmPrefixTreeActor", namespace=f"serve::{app}::SmallModel")
    times = []
    for i in range(n):
        start = time.perf_counter()
        ray.get(tree.prefix_match.remote(prompts[i % len(prompts)], None))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def summary(app: str, ids: dict[str, str], latencies: list[float], served: dict[str, tuple[str, ...]]) -> dict:
    """Hits (a replica that served the system prompt before), prefills, load, latency."""
    hits, per_replica = 0, Counter()
    for replica, order in served.items():
        seen: set[str] = set()
        for rid in order:
            if rid in ids:
                per_replica[replica] += 1
                hits += ids[rid] in seen
                seen.add(ids[rid])
    n = len(ids)
    assert sum(per_replica.values()) == n, f"{app}: found {sum(per_replica.values())} of {n} requests on the replicas"
    latencies = sorted(latencies)
    return {
        "prefix_routing": MODES[app],
        "requests": n,
        "hit_share": hits / n,
        "system_prompt_prefills": n - hits,
        "requests_per_replica": sorted(per_replica.values(), reverse=True),
        "latency_p50_s": statistics.median(latencies),
        "latency_p90_s": latencies[int(0.9 * n)],
    }


def measure(args) -> tuple[list[dict], dict[str, float]]:
    def edit(config: dict, dirs) -> None:
        base = config["applications"][0]
        apps = []
        for name, enabled in MODES.items():
            app = json.loads(json.dumps(base))
            app.update(name=name, route_prefix=f"/{name}")
            app["args"]["prefix_routing"] = {"enabled": enabled, "max_imbalance": args.max_imbalance}
            apps.append(app)
        config["applications"] = apps

    rounds = []
    with tempfile.TemporaryDirectory() as root, running_app(Path(root), replicas={"small": 2}, edit=edit) as served:
        for r in tqdm(range(args.rounds), desc="rounds"):
            prompts = system_prompts(args.prompts, r)
            mix = workload(len(prompts), args.requests, args.seed + r)
            for app in list(MODES) if r % 2 == 0 else list(MODES)[::-1]:
                ids, latencies = asyncio.run(send(f"{served.url}/{app}", prompts, mix, args.concurrency, args.tokens))
                rounds.append({"round": r, "app": app, **summary(app, ids, latencies, asyncio.run(placements(app)))})
        round_trip = {"affinity": match_round_trip_ms("affinity", system_prompts(args.prompts, 0))}
    return rounds, round_trip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="system prompts per round")
    ap.add_argument("--requests", type=int, default=64, help="requests per round")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens of each request")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each with new system prompts")
    ap.add_argument("--max-imbalance", type=int, default=8, help="prefix_routing.max_imbalance of `affinity`")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/prefix_routing.json"))
    args = ap.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Ray's logging config would print every request
    rounds, round_trip = measure(args)
    mixes = [workload(args.prompts, args.requests, args.seed + r) for r in range(args.rounds)]
    ceiling = statistics.mean(1 - len({k for k, _ in mix}) / len(mix) for mix in mixes)
    print(
        f"\n{args.prompts} system prompts, {args.requests} requests, {args.concurrency} in flight, "
        f"{args.rounds} rounds; max_imbalance {args.max_imbalance}; hit share ceiling {ceiling:.3f}"
    )
    print(f"{'routing':<16}{'hit share':>10}{'prefills':>10}{'per replica':>16}{'p50 ms':>8}{'p90 ms':>8}")
    totals = {}
    for app in MODES:
        runs = [r for r in rounds if r["app"] == app]
        load = [sum(x) for x in zip(*(r["requests_per_replica"] for r in runs))]
        totals[app] = {
            "hit_share": statistics.mean(r["hit_share"] for r in runs),
            "system_prompt_prefills_per_round": statistics.mean(r["system_prompt_prefills"] for r in runs),
            "requests_per_replica": load,  # each round's busier replica first, summed
            "latency_p50_s": statistics.median(r["latency_p50_s"] for r in runs),
            "latency_p90_s": statistics.median(r["latency_p90_s"] for r in runs),
        }
        t = totals[app]
        name = "prefix affinity" if MODES[app] else "power of two"
        print(
            f"{name:<16}{t['hit_share']:>10.3f}{t['system_prompt_prefills_per_round']:>10.1f}"
            f"{str(load):>16}{1e3 * t['latency_p50_s']:>8.0f}{1e3 * t['latency_p90_s']:>8.0f}"
        )
    print(f"prefix tree match round trip (one per request, in the Ingress): {round_trip['affinity']:.2f} ms")
    out = {
        "config": vars(args) | {"ceiling": ceiling, "replicas": 2, "pair": "tiny"},
        "totals": totals,
        "match_round_trip_ms": round_trip["affinity"],
        "rounds": rounds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
