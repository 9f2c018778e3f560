"""The Ray-free parts of deployments/: the catch-up batcher, the RemoteLarge proxy (with a
fake transport standing in for Ray Serve, replicas that die included) and the engine
thread. Tiny models, no Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from backoff_core.errors import KVCapacityError, LargeUnavailable
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.types import GenerationResult, TokenEvent, Verification
from deployments.serving.batcher import CatchUpBatcher
from deployments.serving.catchup_wire import CatchUpCall
from deployments.serving.config import RoutingConfig
from deployments.serving.engine_loop import EngineLoop
from deployments.serving.outcomes import Admitted, Failed, Rejected, error_item, internal_message
from deployments.serving.requests import RoutingOverrides, ServeRequest, generation_request
from tests.support.helpers import engine_for, request
from tests.support.remote_fakes import Dead, FakeEndpoint, remote_engine

# -- the batcher ----------------------------------------------------------------------------


@pytest.mark.parametrize("last_only", [(False,) * 4, (True,) * 4, (True, False, True, False)])
def test_one_forward_for_a_step_of_ragged_catch_ups(pair, loop_thread, last_only):
    """Ragged catch-ups merge into one forward; a call that asks for the last row only gets
    [1, V] (even beside calls that want every row), the others [k, V]."""
    _, large = pair
    runner, alone = ModelRunner(large, "large"), ModelRunner(large, "alone")
    batcher = CatchUpBatcher(runner, batch_wait_s=1.0, batch_gap_s=0.1)
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13]]

    async def step():
        calls = [
            CatchUpCall(f"s{i}", 0, tuple(p), "g0", len(prompts), last_only=last)
            for i, (p, last) in enumerate(zip(prompts, last_only))
        ]
        tasks = []
        for call in calls:  # arriving one by one, as from a router
            tasks.append(asyncio.ensure_future(batcher.extend(call)))
            await asyncio.sleep(0.005)
        return await asyncio.gather(*tasks)

    replies = loop_thread.run(step())
    assert batcher.stats.forward_passes == 1 and batcher.stats.batch_sizes == {4: 1}
    for i, (p, reply, last) in enumerate(zip(prompts, replies, last_only)):
        alone.open(f"a{i}")
        expected = alone.extend([(f"a{i}", p)])[0].logits[-1:] if last else alone.extend([(f"a{i}", p)])[0].logits
        assert reply.logits.shape == (1 if last else len(p), runner.vocab_size)
        torch.testing.assert_close(torch.from_numpy(reply.logits), expected, rtol=1e-4, atol=1e-4)


def test_a_gap_ends_the_wait_for_calls_that_went_elsewhere(pair, loop_thread):
    batcher = CatchUpBatcher(ModelRunner(pair[1], "large"), batch_wait_s=5.0, batch_gap_s=0.02)

    async def step():  # 2 of the step's 4 calls were routed to another replica
        start = time.monotonic()
        await asyncio.gather(*[batcher.extend(CatchUpCall(f"s{i}", 0, (3, 4), "g", 4)) for i in range(2)])
        return time.monotonic() - start

    assert loop_thread.run(step()) < 1.0
    assert batcher.stats.batch_sizes == {2: 1}


def test_unbatched_runs_one_forward_per_call(pair, loop_thread):
    batcher = CatchUpBatcher(ModelRunner(pair[1], "large"), batching=False)

    async def step():
        return await asyncio.gather(*[batcher.extend(CatchUpCall(f"s{i}", 0, (3, 4 + i), "g", 4)) for i in range(4)])

    loop_thread.run(step())
    assert batcher.stats.forward_passes == 4 and batcher.stats.batch_sizes == {1: 4}


def test_past_creates_crops_or_loses_a_session(pair, loop_thread):
    runner = ModelRunner(pair[1], "large")
    batcher = CatchUpBatcher(runner)
    run = loop_thread.run
    assert run(batcher.extend(CatchUpCall("k", 0, (3, 4, 5, 6)))).logits is not None
    assert runner.length("k") == 4
    lost = run(batcher.extend(CatchUpCall("k", 9, (7,))))
    assert lost.logits is None and "expects 9" in lost.lost
    assert run(batcher.extend(CatchUpCall("missing", 3, (7,)))).logits is None
    # a rollback: the caller says 2 positions survive, then sends a different token
    rolled = run(batcher.extend(CatchUpCall("k", 2, (9,))))
    fresh = ModelRunner(pair[1], "fresh")
    fresh.open("f")
    torch.testing.assert_close(
        torch.from_numpy(rolled.logits), fresh.extend([("f", [3, 4, 9])])[0].logits[-1:], rtol=1e-4, atol=1e-4
    )
    assert batcher.stats.lost == 2


def test_idle_sessions_expire(pair, loop_thread):
    runner = ModelRunner(pair[1], "large")
    batcher = CatchUpBatcher(runner)
    loop_thread.run(batcher.extend(CatchUpCall("old", 0, (3, 4))))
    time.sleep(0.05)
    loop_thread.run(batcher.extend(CatchUpCall("new", 0, (3, 4))))
    assert loop_thread.run(batcher.expire(0.03)) == ["old"]
    assert runner.request_ids() == ["new"]


# -- RemoteLarge over a fake transport --------------------------------------------------------

REQUESTS = [
    request([3, 4, 5], max_tokens=20, router="entropy", thresholds=(0.3,)),
    request([6, 7], max_tokens=14, router="random", rate=0.4, seed=5, temperature=0.8),
    request([8, 9, 10, 11], max_tokens=17, router="always-large"),
]


def test_remote_large_equals_in_process(pair, tokenizer, loop_thread):
    endpoint = FakeEndpoint(pair[1], loop_thread)
    engine, remote = remote_engine(pair, tokenizer, endpoint)
    served = engine.generate_many(REQUESTS)
    local = engine_for(pair, tokenizer).generate_many(REQUESTS)
    for out, ref in zip(served, local):
        assert (out.token_ids, out.sources) == (ref.token_ids, ref.sources)
    assert any(0 < r.backoff_rate < 1 for r in served)
    # one call per session per catch-up, carrying all of its pending ids (a chunk)
    lengths = sorted(c.length for r in served for c in r.catch_ups if c.level == 1)
    assert sorted(len(c.ids) for c in endpoint.calls) == lengths and max(lengths) > 1
    groups: dict[str, list[str]] = {}
    for c in endpoint.calls:
        groups.setdefault(c.group, []).append(c.session_key)
    assert all(len(set(g)) == len(g) == c.group_size for c in endpoint.calls for g in [groups[c.group]])
    assert max(len(g) for g in groups.values()) > 1  # requests of one step went out together
    assert remote.lost_sessions == 0
    assert not any(b.runner.request_ids() for b in endpoint.replicas)  # freed on finish


def test_lost_replica_is_re_prefilled_and_the_output_is_unchanged(pair, tokenizer, loop_thread):
    endpoint = FakeEndpoint(pair[1], loop_thread)
    engine, remote = remote_engine(pair, tokenizer, endpoint)
    req = request([3, 4, 5], max_tokens=30, router="always-large")
    request_id = engine.submit(req)
    for _ in range(8):
        engine.step()
    victim = endpoint.holder()
    endpoint.dead.add(victim)  # the replica holding the session dies; the router learns it on the next call
    while engine.has_work():
        engine.step()
    result = engine.finish(request_id)
    assert remote.lost_sessions >= 1 and victim in endpoint.noticed
    assert result.token_ids == engine_for(pair, tokenizer).generate(req).token_ids
    assert endpoint.calls[-1].past > 0 and any(
        c.past == 0 and c.session_key.split("#")[1] != endpoint.calls[0].session_key.split("#")[1]
        for c in endpoint.calls
    )


def test_rollbacks_reach_the_replica_as_a_shorter_past(pair, tokenizer, loop_thread):
    endpoint = FakeEndpoint(pair[1], loop_thread, replicas=1)
    engine, _ = remote_engine(pair, tokenizer, endpoint)
    req = request(
        [3, 4, 5], max_tokens=24, router="random", rate=0.7, seed=3, verification=Verification.KL, tolerance=0.0
    )
    served = engine.generate(req)
    local = engine_for(pair, tokenizer).generate(req)
    assert served.rollbacks > 0 and (served.token_ids, served.sources) == (local.token_ids, local.sources)


def test_fresh_session_on_a_dead_replica_is_retried(pair, tokenizer, loop_thread):
    endpoint = FakeEndpoint(pair[1], loop_thread)
    original = endpoint.extend
    failures = []

    def flaky(call):
        if call.past == 0 and not failures:
            failures.append(call.session_key)

            class Gone:
                def result(self, timeout_s=None):
                    raise Dead("gone before it answered")

            return Gone()
        return original(call)

    endpoint.extend = flaky
    engine, remote = remote_engine(pair, tokenizer, endpoint)
    result = engine.generate(request([3, 4], max_tokens=6, router="always-large"))
    assert failures and len(result.token_ids) == 6 and remote.lost_sessions == 0


# -- the engine thread ------------------------------------------------------------------------


def _serve_request(request_id, prompt, max_tokens=8, **overrides) -> ServeRequest:
    return ServeRequest(
        request_id, request(prompt, max_tokens).sampling, RoutingOverrides(**overrides), prompt_ids=tuple(prompt)
    )


def test_engine_loop_streams_batches_and_reads_the_policy_per_step(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    admitted_policies = []

    def admit(req, policy):
        admitted_policies.append(policy.thresholds)
        return generation_request(req, list(req.prompt_ids), policy)

    loop = EngineLoop(engine, admit, RoutingConfig(router="entropy", threshold=[0.3]))
    loop.start()

    async def consume(request_id, prompt, **overrides):
        q = loop.submit(_serve_request(request_id, prompt, **overrides))
        items = []
        while not items or not isinstance(items[-1], (GenerationResult, Rejected)):
            items.append(await q.get())
        return items

    async def main():
        first = await asyncio.gather(consume("a", [3, 4, 5]), consume("b", [6, 7]), consume("bad", [3], router="nope"))
        await asyncio.sleep(0.2)  # the engine thread is idle, waiting for work
        loop.policy = RoutingConfig(router="entropy", threshold=[99.0])  # what reconfigure does
        second = await consume("c", [3, 4, 5])
        return first, second

    try:
        (a, b, bad), c = asyncio.run(main())
    finally:
        loop.stop()
    for items in (a, b, c):
        assert isinstance(items[0], Admitted) and isinstance(items[-1], GenerationResult)
        assert [e.token_id for e in items[1:-1] if isinstance(e, TokenEvent)] == list(items[-1].token_ids)
    assert isinstance(bad[0], Rejected) and "unknown router" in bad[0].message
    assert engine.live_ids() == []
    expected = engine_for(pair, tokenizer).generate(request([3, 4, 5], 8, router="entropy", thresholds=(0.3,)))
    assert a[-1].token_ids == expected.token_ids
    assert c[-1].backoff_rate == 1.0 and a[-1].backoff_rate < 1.0  # the new policy, for the new request
    assert loop.steps < 8 + 8 + 8  # a and b shared steps


def test_requests_that_arrive_together_are_admitted_together_and_refused_one_by_one(pair, tokenizer):
    """A batch's prompts queue up together: one engine.submit_many (one prefill); when the
    engine refuses it (a token id outside the vocabulary), each is admitted alone and only
    the bad one is refused. An echo request's Admitted carries its prompt ids."""
    engine = engine_for(pair, tokenizer)
    calls = []
    submit_many = engine.submit_many
    engine.submit_many = lambda requests, *a: calls.append(len(requests)) or submit_many(requests, *a)

    async def main(prompts, echo=False):
        loop = EngineLoop(engine, lambda r, p: generation_request(r, list(r.prompt_ids), p), RoutingConfig())
        queues = [
            loop.submit(dataclasses.replace(_serve_request(f"r{i}", p), echo=echo)) for i, p in enumerate(prompts)
        ]
        loop.start()  # they were all queued before the engine thread looked
        try:
            out = []
            for q in queues:
                items = [await q.get()]
                while not isinstance(items[-1], (GenerationResult, Rejected, Failed)):
                    items.append(await q.get())
                out.append(items)
            return out
        finally:
            loop.stop()

    good = asyncio.run(main([[3, 4], [5, 6, 7], [8]], echo=True))
    assert calls == [3]
    assert [items[0].prompt_ids for items in good] == [(3, 4), (5, 6, 7), (8,)]
    mixed = asyncio.run(main([[3, 4], [3, 999], [8]]))
    assert calls == [3, 3, 1, 1, 1]  # refused whole: then one by one (submit is submit_many of one)
    assert isinstance(mixed[1][0], Rejected) and "must be in [0, 48)" in mixed[1][0].message
    for items in (*good, mixed[0], mixed[2]):
        assert isinstance(items[0], Admitted) and isinstance(items[-1], GenerationResult)
    assert mixed[0][0].prompt_ids is None  # no echo asked
    assert [r[-1].token_ids for r in (mixed[0], mixed[2])] == [good[0][-1].token_ids, good[2][-1].token_ids]

    def down(requests, *a):  # a larger model scoring the prompts did not answer: no request's fault
        calls.append(len(requests))
        raise LargeUnavailable("large did not answer in 1 s")

    engine.submit_many = down
    failed = asyncio.run(main([[3, 4], [5, 6]], echo=True))
    assert calls[-1:] == [2] and len(calls) == 6  # not retried one by one (a timeout each)
    assert all(isinstance(items[0], Failed) and items[0].unavailable for items in failed)
    assert engine.live_ids() == []


@pytest.mark.parametrize(
    "exc, at_admission, once_admitted",
    [
        (ValueError("bad prompt"), Rejected("bad prompt"), Failed(internal_message("r1"), code="internal_error")),
        (
            KVCapacityError("no slot"),
            Failed("no slot", unavailable=True, code="kv_capacity"),
            Failed("no slot", unavailable=True, code="kv_capacity"),
        ),
        (LargeUnavailable("M_L down"), Failed("M_L down", unavailable=True), Failed("M_L down", unavailable=True)),
        (
            RuntimeError("boom: <AioRpcError RESOURCE_EXHAUSTED>"),
            Failed(internal_message(), code="internal_error"),
            Failed(internal_message("r1"), code="internal_error"),
        ),
    ],
)
def test_one_mapping_of_errors_to_items_for_a_refusal_and_a_failure(exc, at_admission, once_admitted):
    """EngineLoop's one mapping: a refused request and one its own error ended get the same
    item, but for a ValueError, which is the client's only before admission."""
    assert error_item(exc, admitted=False) == at_admission
    assert error_item(exc, admitted=True, request_id="r1") == once_admitted
    # a failure's message is written for the client: no exception text (that is logged)
    assert "boom" not in error_item(exc, admitted=True, request_id="r1").message


def test_engine_loop_cancel_frees_the_request(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    loop = EngineLoop(engine, lambda r, p: generation_request(r, list(r.prompt_ids), p), RoutingConfig())
    loop.start()

    async def main():
        q = loop.submit(_serve_request("x", [3, 4], max_tokens=400))
        await q.get()  # admitted
        await q.get()  # a first token
        loop.cancel("x")
        for _ in range(100):
            if not engine.live_ids():
                return True
            await asyncio.sleep(0.02)
        return False

    try:
        assert asyncio.run(main())
    finally:
        loop.stop()


def test_close_soon_takes_no_lock_so_a_del_inside_a_submit_cannot_hang(pair, loop_thread, monkeypatch):
    """A session's registration is freed by its __del__, which a collection can run inside
    any ThreadPoolExecutor.submit of that thread, while submit holds concurrent.futures'
    global lock: close_soon must not take it (a submit there waited for itself forever)."""
    import concurrent.futures.thread as futures_thread
    import threading

    runner = ModelRunner(pair[1], "large")
    batcher = CatchUpBatcher(runner)
    loop_thread.run(batcher.extend(CatchUpCall("k", 0, (3, 4))))
    held = threading.Lock()  # stands in for the global lock, so a failure strands no real one
    monkeypatch.setattr(futures_thread, "_global_shutdown_lock", held)

    def inside_a_submit():
        with held:  # as ThreadPoolExecutor.submit holds it when a collection runs the __del__
            batcher.close_soon("k")

    thread = threading.Thread(target=inside_a_submit, daemon=True)
    thread.start()
    thread.join(5.0)
    assert not thread.is_alive(), "close_soon waited for a lock its own thread holds"
    deadline = time.monotonic() + 5.0
    while runner.has("k"):  # the event loop then frees the session on the forward thread
        assert time.monotonic() < deadline, "the session was never freed"
        time.sleep(0.01)


def test_a_session_closed_before_any_call_is_freed_once_calls_come(pair, loop_thread):
    runner = ModelRunner(pair[1], "large")
    batcher = CatchUpBatcher(runner)
    runner.open("early")
    batcher.close_soon("early")  # no event loop known yet
    assert runner.has("early")
    loop_thread.run(batcher.extend(CatchUpCall("k", 0, (3, 4))))
    deadline = time.monotonic() + 5.0
    while runner.has("early"):
        assert time.monotonic() < deadline, "the early close was never carried out"
        time.sleep(0.01)
