"""The prefix cache through BackoffEngine: greedy outputs with the cache on equal those with
it off, token for token and source for source, for M_S's prompt prefill and M_L's first
catch-up (a router that backs off), on per-session caches and static slots; the per-request
switch, prompt scoring and eager prefill; exact counts of what each model looked up."""

from __future__ import annotations

import pytest

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.factory import make_runner
from backoff_core.types import GenerationRequest, KVSpec, PrefixCacheSpec, RoutingParams, SamplingParams, Verification

B = 4
SYSTEM = (5, 9, 14, 3, 22, 7, 31, 2, 17, 40, 8, 8, 19, 27, 33, 6, 12, 44, 21, 10)  # 20 tokens: 5 blocks
USERS = [(11, 12, 13), (20, 21, 22, 23, 24, 25), (11, 12, 30), (2,)]
STORAGES = {"per-session": None, "static": KVSpec(budget_tokens=8 * 64, max_len=64)}


def _engine(pair, tokenizer, kv: KVSpec | None, budget: int | None = 256, chunk: int | None = None) -> BackoffEngine:
    spec = PrefixCacheSpec(budget, B) if budget is not None else None
    small, large = pair
    runners = [
        make_runner(small, "small", kv, small=True, prefix_cache=spec),
        make_runner(large, "large", kv, prefix_cache=spec),
    ]
    return BackoffEngine(runners, tokenizer, prefill_chunk_tokens=chunk)


def _request(prompt, seed: int = 0, max_tokens: int = 10, **routing) -> GenerationRequest:
    routing = {"router": "random", "rate": 0.5, **routing}
    return GenerationRequest(
        tuple(prompt), SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True), RoutingParams(**routing)
    )


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(
    "routing",
    [{}, {"verification": Verification.KL, "tolerance": 0.5}, {"eager_prefill": True}],
    ids=["backoff", "kl-verification", "eager-prefill"],
)
def test_outputs_with_the_cache_equal_outputs_without(pair, tokenizer, storage, routing):
    on, off = _engine(pair, tokenizer, STORAGES[storage]), _engine(pair, tokenizer, STORAGES[storage], None)
    for seed, user in enumerate(USERS * 2):
        request = _request(SYSTEM + user, seed=seed, **routing)
        a, b = on.generate(request), off.generate(request)
        assert (a.token_ids, a.sources, a.rollbacks) == (b.token_ids, b.sources, b.rollbacks)
        assert sum(c.level == 1 for c in a.catch_ups) > 0  # M_L ran: its first catch-up adopted
    small, large = (m.prefix_stats() for m in on.models)
    assert small.hits >= 7 and large.hits >= 7 and small.cached_tokens >= 7 * 20


@pytest.mark.parametrize("storage", STORAGES)
def test_exact_counts_for_a_script(pair, tokenizer, storage):
    engine = _engine(pair, tokenizer, STORAGES[storage])
    results = [engine.generate(_request(SYSTEM + user, router="always-large")) for user in USERS]
    # M_S adopts at admission (ids = the prompt, at most len - 1 positions); M_L at its first
    # catch-up (the step's M_S token is not committed yet: ids = the prompt too)
    lengths = [len(SYSTEM + u) for u in USERS]  # 23, 26, 23, 21
    # r0: a miss; r1: SYSTEM's 5 blocks (its block 5 is new); r2: 5 blocks (its block 5 would
    # need 24 tokens: 22 may be loaded); r3: 5 blocks = its whole head (M_S prefills nothing)
    expected = [0, 20, 20, 20]
    for model in engine.models:
        s = model.prefix_stats()
        assert (s.lookups, s.hits, s.misses) == (4, 3, 1)
        assert s.cached_tokens == sum(expected) and s.lookup_tokens == sum(lengths)
        # stored (whole blocks of prompt only): r0 blocks 0-4 (20 of 23), r1 block 5 (24 of 26)
        assert s.stored_blocks == 5 + 1 and s.tokens == 6 * B
    # what M_L prefilled at its first catch-up: the prompt minus what it adopted
    assert [r.catch_ups[0].prompt_tokens for r in results] == [n - e for n, e in zip(lengths, expected)]
    # what each result reports as cached (usage.prompt_tokens_details.cached_tokens): M_S's
    assert [r.cached_prompt_tokens for r in results] == expected


def test_the_per_request_switch_and_prompt_scoring_skip_the_cache(pair, tokenizer):
    engine = _engine(pair, tokenizer, None)
    engine.generate(_request(SYSTEM + USERS[0], router="always-large", prefix_cache=False))
    scored = GenerationRequest(
        SYSTEM + USERS[0], SamplingParams(max_tokens=4, prompt_logprobs=1), RoutingParams(router="always-large")
    )
    engine.generate(scored)  # every prompt row scored: both models prefill it all
    for model in engine.models:
        assert (model.prefix_stats().lookups, model.prefix_stats().stored_blocks) == (0, 0)
    engine.generate(_request(SYSTEM + USERS[0], router="always-large"))
    for model in engine.models:
        s = model.prefix_stats()
        assert (s.lookups, s.misses, s.stored_blocks) == (1, 1, 5)


def test_a_cache_too_small_for_the_prompt_changes_nothing(pair, tokenizer):
    on, off = _engine(pair, tokenizer, None, budget=2 * B), _engine(pair, tokenizer, None, None)
    for seed in range(3):
        request = _request(SYSTEM + USERS[1], seed=seed)
        assert on.generate(request).token_ids == off.generate(request).token_ids
    small = on.models[0].prefix_stats()
    assert small.tokens == 2 * B and small.cached_tokens == 2 * 2 * B  # 2 blocks kept, 2 hits


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("router", ["random", "always-large"])
def test_chunked_prefill_starts_from_the_cached_prefix(pair, tokenizer, storage, router):
    """Chunks of 6 (the 20-token system prompt is a backlog of several chunks at admission and
    at M_L's first catch-up): a fresh session adopts its cached prefix and only the rest is fed
    in chunks; outputs equal the cache off, chunked or not."""
    kv = STORAGES[storage]
    on = _engine(pair, tokenizer, kv, chunk=6)
    offs = [_engine(pair, tokenizer, kv, None, chunk=6), _engine(pair, tokenizer, kv, None)]
    for seed, user in enumerate(USERS * 2):
        request = _request(SYSTEM + user, seed=seed, router=router)
        a = on.generate(request)
        # M_S's cached positions: whole blocks of the head (all but the last prompt token); SYSTEM's
        # 5 in the first round, every whole block of the head in the second (each prompt seen)
        head_blocks = (len(SYSTEM + user) - 1) // B * B
        assert a.cached_prompt_tokens == (
            0 if seed == 0 else head_blocks if seed >= len(USERS) else min(20, head_blocks)
        )
        for off in offs:
            b = off.generate(request)
            assert (a.token_ids, a.sources) == (b.token_ids, b.sources)
            assert b.cached_prompt_tokens == 0
    small, large = (m.prefix_stats() for m in on.models)
    assert small.hits == len(USERS) * 2 - 1 and large.hits >= len(USERS)  # every prompt after the first
