"""The LargeModel deployment's own decisions, with Ray not started (the user class, its
model loading and Serve's multiplexer replaced by tests.support.serve_fakes): live catch-up
config, session registration for affinity, batched catch-up bookkeeping, and every way a
session is freed (close, multiplexer eviction, lease). The batcher's numerics are tested in
tests/deployments/serving/test_engine_loop.py; the deployment under Serve in test_app*.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from backoff_core.runners.scoring import Scoring
from deployments.serving.catchup_wire import CatchUpCall
from tests.support.serve_fakes import FakeHandle, LoopThread, large_replica
from tests.support.tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(2, hidden=64, layers=4, sharpness=30)


@pytest.fixture
def lt():
    thread = LoopThread()
    yield thread
    thread.stop()


@pytest.fixture
def large(monkeypatch, model):
    replica = large_replica(monkeypatch, model)
    yield replica
    replica.batcher.shutdown()


def _extend(handle: FakeHandle, call: CatchUpCall):
    return handle.options(multiplexed_model_id=call.session_key).extend.remote(call)


def _until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_reconfigure_reaches_the_batcher_and_the_lease(large, lt):
    large.reconfigure({"batching": False, "max_batch_size": 3, "batch_wait_ms": 40, "batch_gap_ms": 2, "lease_s": 12.0})
    b = large.batcher
    assert (b.batching, b.max_batch_size, b.batch_wait_s, b.batch_gap_s) == (False, 3, 0.04, 0.002)
    assert lt.run(large.renew("small-1")) == 12.0
    assert large.info().config.lease_s == 12.0
    large.reconfigure({})  # an emptied user_config: back to the defaults
    assert (b.batching, b.max_batch_size) == (True, 64)


def test_a_call_must_carry_its_session_key_as_multiplexed_id(large, lt):
    """Else affinity would send the session's next calls to a replica that lacks it."""
    with pytest.raises(ValueError, match="multiplexed_model_id"):
        lt.run(large.extend(CatchUpCall("a#1", 0, (3, 4))))  # no request context: id ""
    assert large.runner.request_ids() == []


def test_sessions_register_when_created_or_held_and_not_when_lost(large, lt):
    handle, mux = FakeHandle([large], lt), large._register
    _extend(handle, CatchUpCall("a#1", 0, (3, 4, 5))).result(10)  # created: registered
    _extend(handle, CatchUpCall("a#1", 3, (6,))).result(10)  # held: registered again (LRU use)
    lost = _extend(handle, CatchUpCall("gone#1", 4, (7,))).result(10)  # not here: answered lost
    assert lost.logits is None and lost.lost
    assert mux.loads == ["a#1"] and list(mux.held) == ["a#1"]
    assert large.runner.length("a#1") == 4


def test_one_step_of_many_sessions_is_one_forward(large, lt):
    handle = FakeHandle([large], lt)
    large.reconfigure({"batch_wait_ms": 5000})  # the step's calls, not a timer, end the wait
    prompts = {"a#1": (3, 4, 5), "b#1": (6, 7), "c#1": (8,)}
    pending = [
        _extend(handle, CatchUpCall(key, 0, ids, "step-0", len(prompts), owner="small-1"))
        for key, ids in prompts.items()
    ]
    replies = [p.result(30) for p in pending]
    assert [r.logits.shape[0] for r in replies] == [3, 2, 1]
    info = large.info()
    assert (info.forward_passes, info.calls, info.batch_sizes) == (1, 3, ((3, 1),))
    assert sorted(info.sessions) == sorted(prompts) and info.owners == (("small-1", 3),)
    assert info.kv_tokens == 6 and info.lost == 0


def test_close_and_multiplexer_eviction_free_a_session(large, lt):
    handle = FakeHandle([large], lt)
    for key in ("a#1", "b#1"):
        _extend(handle, CatchUpCall(key, 0, (3, 4))).result(10)
    handle.options(multiplexed_model_id="a#1").close.remote("a#1").result(10)
    assert large.runner.request_ids() == ["b#1"]
    large._register.evict("b#1")  # Serve's LRU dropped the registration: the session goes with it
    assert _until(lambda: large.runner.request_ids() == [])


def test_evicting_beyond_the_multiplexer_bound_frees_the_oldest(monkeypatch, model, lt):
    large = large_replica(monkeypatch, model, capacity=2)
    handle = FakeHandle([large], lt)
    for key in ("a#1", "b#1", "c#1"):
        _extend(handle, CatchUpCall(key, 0, (3, 4))).result(10)
    assert _until(lambda: sorted(large.runner.request_ids()) == ["b#1", "c#1"])
    large.batcher.shutdown()


def test_the_sweeper_frees_the_sessions_of_a_silent_owner_only(large, lt):
    """A SmallModel replica that stops renewing (it died) loses its sessions after lease_s;
    one that renews keeps them. Whoever sees a session gone sees its records gone with it
    (the runner's close made slow here: the forward thread frees it while info() reads)."""
    handle = FakeHandle([large], lt)
    close = large.runner.close
    large.runner.close = lambda session_key: close(session_key) or time.sleep(0.3)
    large.reconfigure({"lease_s": 1.0})  # the sweeper wakes every lease_s / 4
    _extend(handle, CatchUpCall("dead#1", 0, (3, 4), owner="small-dead")).result(10)
    _extend(handle, CatchUpCall("live#1", 0, (5, 6), owner="small-live")).result(10)

    async def renew_until_freed():
        while "dead#1" in large.runner.request_ids():
            await handle.broadcast("renew", "small-live").results_async(timeout_s=5)
            await asyncio.sleep(0.05)

    lt.run(renew_until_freed(), timeout=30)
    info = large.info()
    assert info.sessions == ("live#1",) and info.orphans_freed == 1 and info.owners == (("small-live", 1),)


def test_a_scored_catch_up_answers_its_rows_not_full_logits(large, lt, model):
    """Prompt logprobs: the call names rows and targets, the reply carries their log-probabilities
    and top-n (deployments/serving/batcher.py ScoredRows) beside the last row's logits."""
    handle = FakeHandle([large], lt)
    call = CatchUpCall("a#1", 0, (3, 4, 5, 6), last_only=True, scoring=Scoring((0, 2), (4, 6), top_n=2))
    reply = _extend(handle, call).result(10)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([[3, 4, 5, 6]])).logits[0].float(), -1)
    assert reply.logits.shape == (1, large.runner.vocab_size)
    torch.testing.assert_close(torch.from_numpy(reply.scored.target), expected[[0, 2], [4, 6]], atol=1e-4, rtol=0)
    assert reply.scored.top_ids.tolist() == torch.topk(expected[[0, 2]], 2).indices.tolist()
    assert large.runner.length("a#1") == 4  # the session holds the prompt head for the catch-ups to come
