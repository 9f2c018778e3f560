"""A model over tensor-parallel ranks (backoff_core/parallel/ranks.py) on the CPU (gloo):
logits equal TP=1's after every catch-up, the engine's greedy tokens equal, a rank that dies
fails the catch-up at once and the engine degrades its requests. Each group starts N - 1
rank processes (seconds each on two cores), so the module shares them and is `slow`."""

from __future__ import annotations

import os
import signal
import time

import pytest

from backoff_core.engine.engine import BackoffEngine
from backoff_core.parallel.ranks import RankFailure, parallel_runner
from backoff_core.runners.factory import make_runner
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams
from tests.support.tiny import VOCAB, tiny_model
from tests.support.tp_models import tp_model

pytestmark = pytest.mark.slow
TOL = 1e-4  # fp32: TP=N sums the row-split products in another order


STATIC = KVSpec(budget_tokens=8 * 128, max_len=128, cuda_graphs=False)


@pytest.fixture(scope="module")
def large():
    return tp_model()


@pytest.fixture(scope="module")
def tp2(large):
    runner = parallel_runner(large, "large", None, tensor_parallel=2)  # per-session caches
    yield runner
    runner.shutdown()


@pytest.fixture(scope="module")
def tp3(large):
    runner = parallel_runner(large, "large", STATIC, tensor_parallel=3)  # static KV slots
    yield runner
    runner.shutdown()


def _script(runners, prefix: str) -> int:
    """Prefills, catch-ups of 1-5 tokens over three sessions, a rollback, a close and reopen,
    a prompt adopted from the prefix cache; every extend's logits compared. Extends run."""
    prompt = [(7 * i) % (VOCAB - 1) + 1 for i in range(40)]
    extends = [
        [("a", prompt), ("b", prompt[:9])],
        [("a", [3]), ("b", [4, 5, 6])],
        [("c", [9, 8, 7, 6, 5]), ("a", [1, 2])],
        "crop a 41",
        [("a", [11, 12, 13]), ("b", [2]), ("c", [4])],
        "reopen b",
        [("b", prompt + [5])],  # adopts the 32-token block "a" stored
        [("a", [6]), ("b", [7, 8]), ("c", [1, 2, 3, 4])],
    ]
    for r in runners:
        for sid in "abc":
            r.open(prefix + sid)
        assert r.adopt_prefix(prefix + "a", prompt) == 0  # a miss: "a" stores its prompt's blocks
    count = 0
    for step in extends:
        if isinstance(step, str):
            what, sid, *n = step.split()
            for r in runners:
                if what == "crop":
                    r.crop(prefix + sid, int(n[0]))
                else:
                    r.close(prefix + sid)
                    r.open(prefix + sid)
                    assert r.adopt_prefix(prefix + sid, prompt + [5]) == 32
            continue
        items = [(prefix + sid, ids) for sid, ids in step]
        ref, got = (r.extend(items) for r in runners)
        for sid_ids, x, y in zip(step, ref, got):
            assert x.logits.shape == y.logits.shape == (len(sid_ids[1]), VOCAB)
            assert (x.logits - y.logits).abs().max().item() < TOL, (step, sid_ids[0])
        count += 1
    for r in runners:
        assert sorted(r.request_ids())[-3:] == [prefix + s for s in "abc"] and r.length(prefix + "a") == 45
        for sid in "abc":
            r.close(prefix + sid)
    return count


def test_tp2_logits_equal_tp1_after_every_catch_up(large, tp2):
    assert _script([make_runner(large, "large", None), tp2], "s2-") == 6
    assert tp2.comm.calls > 0 and tp2.healthy


def test_tp3_on_static_slots_equals_tp1_after_every_catch_up(large, tp3):
    assert _script([make_runner(large, "large", STATIC), tp3], "s3-") == 6
    assert type(tp3.runner).__name__ == "StaticRunner" and tp3.runner.kv.kv_heads == 2  # 6 KV heads / 3


def test_kv_heads_replicated_over_four_ranks_equal_tp1():
    model = tiny_model(2, hidden=64, layers=2, sharpness=30)  # 4 heads, 2 KV heads: each held by 2 ranks
    tp4 = parallel_runner(model, "large", None, tensor_parallel=4)
    try:
        ref = make_runner(model, "large", None)
        for r in (ref, tp4):
            r.open("x")
        for ids in ([1, 2, 3, 4, 5, 6], [7], [8, 9]):
            a, b = ref.extend([("x", ids)])[0], tp4.extend([("x", ids)])[0]
            assert (a.logits - b.logits).abs().max().item() < TOL
    finally:
        tp4.shutdown()


def _requests(n: int, **routing) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            (3 + i, 4, 5, 6),
            SamplingParams(max_tokens=14, ignore_eos=True, seed=i),  # greedy; the seed draws the random router
            RoutingParams(**({"router": "random", "rate": 0.5} | routing)),
            request_id=f"g{i}",
        )
        for i in range(n)
    ]


def test_engine_greedy_tokens_with_a_tp3_large_equal_tp1(large, tp3, tokenizer):
    small = tiny_model(1, sharpness=30)
    one = BackoffEngine(
        [make_runner(small, "small", STATIC, small=True), make_runner(large, "large", STATIC)], tokenizer
    )
    three = BackoffEngine([make_runner(small, "small", STATIC, small=True), tp3], tokenizer)
    want, got = one.generate_many(_requests(3)), three.generate_many(_requests(3))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(r.catch_ups for r in got) and not any(r.degraded for r in got)
    assert tp3.request_ids() == []


def test_a_rank_dying_mid_catch_up_degrades_its_requests_without_a_hang(tokenizer):
    large = tp_model(seed=6)
    tp = parallel_runner(large, "large", None, tensor_parallel=2)
    try:
        engine = BackoffEngine([make_runner(tiny_model(1, sharpness=30), "small", None, small=True), tp], tokenizer)
        ids = [engine.submit(r) for r in _requests(2)]
        for _ in range(4):
            engine.step()
        tp.chaos_exit(rank=1, collectives=3)  # rank 1 exits inside its next forward (layer 1's o_proj)
        start = time.monotonic()
        while engine.has_work():
            engine.step()
        results = [engine.finish(i) for i in ids]
        assert time.monotonic() - start < 30  # no collective left waiting for the dead rank
        assert all(r.degraded and len(r.token_ids) == 14 for r in results)
        assert "rank" in results[0].degraded_reason and not tp.healthy
        with pytest.raises(RankFailure):
            tp.extend([("z", [1])])
    finally:
        tp.shutdown()


def test_a_rank_killed_between_calls_fails_the_next_one_at_once(tp2):
    """Last in the module: it breaks the shared TP=2 group."""
    tp2.open("k")
    tp2.extend([("k", [1, 2, 3])])
    os.kill(tp2.pids()[0], signal.SIGKILL)
    time.sleep(0.5)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="large: a rank process died"):
        tp2.extend([("k", [4])])
    assert time.monotonic() - start < 5 and not tp2.healthy
    tp2.close("k")  # session bookkeeping on a broken group does nothing


def test_a_chain_with_m_s_over_two_ranks_gives_the_same_tokens(tokenizer):
    """backoff generate --small-tp 2: M_S (its hidden states and logits) from rank 0."""
    from backoff_core.models.loading import Chain
    from backoff_core.parallel.ranks import engine_from_chain

    chain = Chain((tiny_model(1, sharpness=30), tp_model(seed=7)), tokenizer, ("s", "l"))
    requests = _requests(2, router="entropy", thresholds=(0.5,), rate=None)
    want = engine_from_chain(chain, [1, 1]).generate_many(requests)
    engine = engine_from_chain(chain, [2, 1])
    try:
        got = engine.generate_many(_requests(2, router="entropy", thresholds=(0.5,), rate=None))
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.sources for r in got] == [r.sources for r in want] and any(1 in r.sources for r in got)
    finally:
        engine.models[0].shutdown()
