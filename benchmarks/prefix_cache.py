"""The prefix cache on the default pair, in-process on this machine (CPU): time to first token
of a request whose 1024-token system prompt was seen before, cold over warm, greedy outputs
with the cache on against off, and the hit rate under a chat-like mix.

    python benchmarks/prefix_cache.py                 # saves benchmarks/results/prefix_cache.json

TTFT (GenerationResult.timings.first_token: admission, prompt prefill and the first step): a
cold request brings a system prompt never seen (a miss), its warm twin the same system prompt
with another user turn. Per router: always-small (M_S's prefill only), always-large (M_S's
prefill and M_L's first catch-up over the whole prompt) and entropy, the Serve default. The
machine is shared and noisy: medians over --reps pairs, each pair measured back to back.
Chat mix: 8 system prompts, 64 requests in a seeded random order, each with its own user turn,
on a fresh engine with the default cache (PrefixCacheSpec()): hits / lookups per model.
"""

from __future__ import annotations

import argparse
import json
import platform
import pydoc_data.topics
import random
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from backoff_core.engine.engine import BackoffEngine
from backoff_core.models.loading import load_chain
from backoff_core.types import GenerationRequest, PrefixCacheSpec, RoutingParams, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "prefix_cache.json"
ROUTERS = ("entropy", "always-large", "always-small")  # entropy: the headline (Serve's default router)


def system_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` distinct system prompts of exactly `length` tokens of English reference text."""
    topics = sorted(pydoc_data.topics.topics.items())
    ids = tokenizer("\n\n".join(text for _, text in topics)).input_ids
    stride = (len(ids) - length) // count
    return [ids[i * stride : i * stride + length] for i in range(count)]


def user_turn(tokenizer, k: int) -> list[int]:
    subjects = ["a for loop", "the with statement", "slicing", "exceptions", "decorators", "imports", "classes"]
    return tokenizer(f"\nUser: In two sentences, how do {subjects[k % len(subjects)]} work? (question {k})\n").input_ids


def request(prompt: list[int], router: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), RoutingParams(router=router)
    )


def stats_of(engine: BackoffEngine) -> list[dict]:
    return [vars(m.prefix_stats()) | {"model": m.name} for m in engine.models]


def ttft(engine: BackoffEngine, systems: list[list[int]], tokenizer, reps: int) -> dict:
    out = {}
    bar = tqdm(total=len(ROUTERS) * reps, desc="ttft cold/warm pairs")
    for r, router in enumerate(ROUTERS):
        cold, warm = [], []
        # a pair first, not timed: the first forwards of new shapes (oneDNN's primitives, the
        # allocator) cost seconds once, and would land in the first cold request
        warmup = systems[len(ROUTERS) * reps + r]
        for j in range(2):
            engine.generate(request(warmup + user_turn(tokenizer, 100 + j), router, 1))
        for i in range(reps):
            system = systems[r * reps + i]  # never seen before: the cold request misses
            a = engine.generate(request(system + user_turn(tokenizer, 2 * i), router, 1))
            b = engine.generate(request(system + user_turn(tokenizer, 2 * i + 1), router, 1))
            cold.append(a.timings.first_token)
            warm.append(b.timings.first_token)
            bar.update()
        out[router] = {
            "cold_s": statistics.median(cold),
            "warm_s": statistics.median(warm),
            "cold_over_warm": statistics.median(cold) / statistics.median(warm),
            "cold_all_s": cold,
            "warm_all_s": warm,
        }
    bar.close()
    return out


def outputs_equal(chain, systems, tokenizer, max_tokens: int) -> tuple[bool, int]:
    """Greedy generations of warm requests (each system prompt seen before) with the cache on
    and with it off: equal token for token and source for source?"""
    on, off = BackoffEngine.from_chain(chain), BackoffEngine.from_chain(chain, prefix_cache=None)
    equal, compared = True, 0
    for k, system in enumerate(tqdm(systems, desc="outputs on vs off")):
        for turn in (0, 1):  # turn 1 finds turn 0's system prompt cached
            req = request(system + user_turn(tokenizer, 10 + 2 * k + turn), "entropy", max_tokens)
            a, b = on.generate(req), off.generate(req)
            equal &= (a.token_ids, a.sources) == (b.token_ids, b.sources)
            compared += 1
    assert on.models[0].prefix_stats().hits == len(systems), "every second turn should hit"
    return equal, compared


def chat_mix(chain, systems, tokenizer, requests: int, max_tokens: int, seed: int) -> dict:
    engine = BackoffEngine.from_chain(chain)  # the default cache
    rng = random.Random(seed)
    order = [rng.randrange(len(systems)) for _ in range(requests)]
    seen = set()
    start = time.perf_counter()
    for k, s in enumerate(tqdm(order, desc="chat mix")):
        engine.generate(request(systems[s] + user_turn(tokenizer, 100 + k), "entropy", max_tokens))
        seen.add(s)
    models = stats_of(engine)
    return {
        "system_prompts": len(systems),
        "requests": requests,
        "first_sight_misses": len(seen),  # the least misses any cache could have
        "seconds": time.perf_counter() - start,
        "hit_rate": {m["model"]: m["hits"] / m["lookups"] for m in models if m["lookups"]},
        "token_hit_rate": {m["model"]: m["cached_tokens"] / m["lookup_tokens"] for m in models if m["lookups"]},
        "models": models,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5, help="cold/warm pairs per router (medians)")
    parser.add_argument("--mix-prompts", type=int, default=8)
    parser.add_argument("--mix-requests", type=int, default=64)
    parser.add_argument("--mix-max-tokens", type=int, default=4)
    parser.add_argument("--equal-max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    start = time.perf_counter()
    chain = load_chain(None, None)
    print(f"default pair loaded in {time.perf_counter() - start:.1f} s")
    tokenizer = chain.tokenizer
    n_systems = len(ROUTERS) * (args.reps + 1) + args.mix_prompts + 4
    systems = system_prompts(tokenizer, n_systems, args.system_tokens)
    timed = ttft(BackoffEngine.from_chain(chain), systems, tokenizer, args.reps)
    mix = chat_mix(
        chain, systems[-args.mix_prompts - 4 : -4], tokenizer, args.mix_requests, args.mix_max_tokens, args.seed
    )
    equal, compared = outputs_equal(chain, systems[-4:], tokenizer, args.equal_max_tokens)
    spec = PrefixCacheSpec()
    result = {
        "ttft_cold_over_warm": timed[ROUTERS[0]]["cold_over_warm"],
        "outputs_equal": equal,
        "hit_rate": mix["hit_rate"],
        "headline_router": ROUTERS[0],
        "system_tokens": args.system_tokens,
        "ttft": timed,
        "outputs_compared": compared,
        "chat_mix": mix,
        "prefix_cache": {"budget_tokens": spec.budget_tokens, "block_tokens": spec.block_tokens},
        "machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads()},
        "command": "python benchmarks/prefix_cache.py",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for router, t in timed.items():
        print(
            f"TTFT {router:>12}: cold {t['cold_s'] * 1000:7.0f} ms  warm {t['warm_s'] * 1000:6.0f} ms  "
            f"cold/warm {t['cold_over_warm']:.1f}x"
        )
    print(f"outputs equal (cache on vs off, {compared} greedy requests): {equal}")
    print(f"chat mix ({mix['system_prompts']} system prompts, {mix['requests']} requests): hit rate {mix['hit_rate']}")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
