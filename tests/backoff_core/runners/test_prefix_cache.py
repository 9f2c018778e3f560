"""The prefix cache (runners/prefix_cache.py): exact bookkeeping on hand-written token scripts,
the budget, and equivalence: a session started from cached blocks gives the logits (and the
greedy tokens) of one prefilled from scratch, on per-session caches and static slots."""

from __future__ import annotations

import pytest
import torch

from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.prefix_cache import PrefixCache
from backoff_core.runners.static import StaticRunner
from backoff_core.types import PrefixCacheSpec

B = 4  # tokens per block in these scripts


def _runner(kind: str, model, budget: int | None) -> ModelRunner | StaticRunner:
    spec = PrefixCacheSpec(budget, B) if budget is not None else None
    if kind == "dynamic":
        return ModelRunner(model, "large", prefix_cache=spec)
    return StaticRunner(model, "large", kv_budget_tokens=4 * 64, max_len=64, evict_idle=True, prefix_cache=spec)


def _greedy(runner, request_id: str, prompt: list[int], steps: int = 6, adopt: bool = True) -> tuple[int, list[int]]:
    """(positions adopted, greedy tokens): adopt the cached prefix, feed the rest, decode."""
    runner.open(request_id)
    n = runner.adopt_prefix(request_id, prompt) if adopt else 0
    assert runner.length(request_id) == n
    (ext,) = runner.extend([(request_id, prompt[n:])], last_only=True)
    tokens = []
    for _ in range(steps):
        tokens.append(int(ext.logits[-1].argmax()))
        (ext,) = runner.extend([(request_id, tokens[-1:])], last_only=True)
    runner.close(request_id)
    return n, tokens


def _kv(n_blocks: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((2, 2, 2, B, 8), fill)  # [layers, 2, kv_heads, B, head_dim]


# -- the cache alone ----------------------------------------------------------------------
def test_hash_chain_finds_the_longest_stored_prefix_and_counts_exactly():
    cache = PrefixCache(PrefixCacheSpec(budget_tokens=64, block_tokens=B))
    chain = []
    for i, block in enumerate([(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]):
        chain.append(cache.store(chain, block, _kv(1, i)))
    assert len(cache) == 3 and cache.stats().stored_blocks == 3
    keys, kv = cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 99], limit=12)  # diverges in block 3
    assert keys == chain[:2] and kv.shape == (2, 2, 2, 2 * B, 8)
    assert kv[..., :B, :].eq(0).all() and kv[..., B:, :].eq(1).all()
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], limit=11)[0] == chain[:2]  # whole blocks in limit
    assert cache.match([2, 2, 3, 4, 5, 6, 7, 8], limit=8) == ([], None)  # same block 2, other parent
    kv[:] = 7  # a copy: the cache keeps its own
    assert cache.match([1, 2, 3, 4], limit=4)[1].eq(0).all()
    cache.record(12, 8)
    cache.record(8, 0)
    s = cache.stats()
    assert (s.lookups, s.hits, s.misses, s.cached_tokens, s.lookup_tokens, s.tokens) == (2, 1, 1, 8, 20, 12)


def test_lru_evicts_leaves_first_and_never_passes_the_budget():
    cache = PrefixCache(PrefixCacheSpec(budget_tokens=3 * B + 1, block_tokens=B))  # 3 blocks
    a = [cache.store([], (1, 1, 1, 1), _kv(1))]
    a.append(cache.store(a, (2, 2, 2, 2), _kv(1)))
    b = [cache.store([], (3, 3, 3, 3), _kv(1))]
    assert len(cache) == 3
    cache.match([1, 1, 1, 1, 2, 2, 2, 2], 8)  # a used last: b's block is the LRU one
    b.append(cache.store(b[:0], (4, 4, 4, 4), _kv(1)))  # a new root evicts b's block, not a's
    assert cache.match([3, 3, 3, 3], 4) == ([], None)
    assert cache.match([1, 1, 1, 1, 2, 2, 2, 2], 8)[0] == a
    c = [cache.store([], (5, 5, 5, 5), _kv(1))]  # evicts (4,...), then a's LEAF before a's root
    c.append(cache.store(c, (6, 6, 6, 6), _kv(1)))
    assert cache.match([1, 1, 1, 1, 2, 2, 2, 2], 8)[0] == a[:1]  # the root survives, reachable
    assert cache.stats().tokens == 3 * B and cache.stats().evicted_blocks == 3  # b's root, (4,...), a's leaf


def test_a_chain_longer_than_the_budget_stops_rather_than_evicting_itself():
    cache = PrefixCache(PrefixCacheSpec(budget_tokens=2 * B, block_tokens=B))
    chain = []
    for block in [(1,) * B, (2,) * B, (3,) * B]:
        key = cache.store(chain, block, _kv(1))
        if key is None:
            break
        chain.append(key)
    assert len(chain) == 2 and cache.stats().evicted_blocks == 0
    assert cache.match([1] * B + [2] * B + [3] * B, 12)[0] == chain


def test_a_budget_below_one_block_is_off():
    assert not PrefixCache(PrefixCacheSpec(budget_tokens=B - 1, block_tokens=B)).enabled
    with pytest.raises(ValueError, match="block"):
        PrefixCacheSpec(block_tokens=0)


# -- runners: cache on == cache off, token for token ---------------------------------------
SYSTEM = [5, 9, 14, 3, 22, 7, 31, 2, 17, 40]  # 10 tokens: two whole blocks, the third diverges mid-block


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_shared_prefix_and_mid_block_divergence(kind, pair):
    _, large = pair
    on, off = _runner(kind, large, 64), _runner(kind, large, None)
    prompts = [SYSTEM + [11, 12, 13], SYSTEM + [20, 21, 22, 23, 24], SYSTEM + [11, 12, 13], SYSTEM[:6] + [1, 1]]
    adopted = []
    for i, prompt in enumerate(prompts):
        n, tokens = _greedy(on, f"r{i}", prompt)
        assert tokens == _greedy(off, f"r{i}", prompt, adopt=False)[1]
        adopted.append(n)
    # r0: a miss, stores 3 blocks (12 of 13 tokens); r1: shares blocks 0-1 (block 2 differs at
    # position 10) and stores its own block 2; r2 = r0: all 3 blocks (12 < 13: one token left
    # to feed); r3 (8 tokens: 7 may be loaded) shares block 0 and stores its block 1
    assert adopted == [0, 8, 12, 4]
    s = on.prefix_stats()
    assert (s.lookups, s.hits, s.misses, s.cached_tokens) == (4, 3, 1, 24)
    assert s.lookup_tokens == 13 + 15 + 13 + 8 and s.stored_blocks == 3 + 1 + 0 + 1 and s.tokens == 5 * B


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_adopted_logits_equal_a_full_prefill(kind, pair):
    _, large = pair
    on, off = _runner(kind, large, 64), _runner(kind, large, None)
    prompt = SYSTEM + [30, 31]
    _greedy(on, "warm", prompt)
    for runner in (on, off):
        runner.open("x")
    assert on.adopt_prefix("x", prompt) == 2 * B  # 3 blocks cached, but one token must be left to feed
    (warm,) = on.extend([("x", prompt[2 * B :])], last_only=False)
    (cold,) = off.extend([("x", prompt)], last_only=False)
    torch.testing.assert_close(warm.logits, cold.logits[2 * B :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_eviction_under_pressure_and_a_prefix_longer_than_the_budget(kind, pair):
    _, large = pair
    on, off = _runner(kind, large, 3 * B), _runner(kind, large, None)
    torch.manual_seed(0)
    p0, p1, p2, p3, p4 = [torch.randint(2, 48, (n,)).tolist() for n in (9, 13, 7, 30, 17)]
    prompts = [p0, p1, p2, p3, p3, p4, p0 + [4, 4], p1]
    adopted = []
    for i, prompt in enumerate(prompts):
        n, tokens = _greedy(on, f"r{i}", prompt)
        assert tokens == _greedy(off, f"r{i}", prompt, adopt=False)[1]
        assert on.prefix_stats().tokens <= 3 * B
        adopted.append(n)
    # each new prompt evicts older ones; the 30-token prompt (7 blocks) keeps its first 3 only
    # (a store never evicts its own chain) and its repeat finds them; p0 and p1 come back evicted
    assert adopted == [0, 0, 0, 0, 3 * B, 0, 0, 0]
    s = on.prefix_stats()
    assert s.evicted_blocks > 0 and s.tokens == 3 * B and s.cached_tokens == sum(adopted)


def test_a_cache_that_is_off_adopts_nothing(pair):
    _, large = pair
    runner = _runner("dynamic", large, None)
    runner.open("a")
    assert runner.adopt_prefix("a", SYSTEM) == 0 and runner.prefix_stats().lookups == 0


def test_adopt_needs_a_fresh_session(pair):
    _, large = pair
    runner = _runner("dynamic", large, 64)
    runner.open("a")
    runner.extend([("a", [1, 2])])
    with pytest.raises(ValueError, match="fresh session"):
        runner.adopt_prefix("a", SYSTEM)


def test_rollback_below_a_stored_block_stores_what_the_session_then_holds(pair):
    _, large = pair
    on, off = _runner("dynamic", large, 64), _runner("dynamic", large, None)
    on.open("a")
    on.adopt_prefix("a", SYSTEM)
    on.extend([("a", SYSTEM[:6])])
    assert on.prefix_stats().stored_blocks == 1  # SYSTEM's block 0
    on.crop("a", 3)  # a rollback: positions 3.. forgotten
    on.extend([("a", [44, 45, 46, 47, 0])])  # positions 3..7: blocks (5, 9, 14, 44), (45, 46, 47, 0)
    assert on.prefix_stats().stored_blocks == 3
    n, tokens = _greedy(on, "b", [5, 9, 14, 44, 45, 46, 47, 0, 1])
    assert n == 8 and tokens == _greedy(off, "b", [5, 9, 14, 44, 45, 46, 47, 0, 1], adopt=False)[1]
