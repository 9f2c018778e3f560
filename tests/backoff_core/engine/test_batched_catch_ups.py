"""Batched catch-ups (engine.py `catch_up_wait_ms`): a request routed to M_L waits, while the
others step, for its catch-up to run in one forward with others'. Exact bookkeeping on
hand-written scripts (which step each token arrives in, which requests share each M_L
forward), the same tokens as catch-ups run at once, and the limits of the wait. The engine's
clock is a counter here: every step lasts `step_s`, so the waits are exact."""

from __future__ import annotations

import itertools

import pytest

from backoff_core.engine.engine import CATCH_UP_WAIT_MS, BackoffEngine
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.types import Verification
from tests.support.catch_up_scripts import pair_runners, run_steps, scripted
from tests.support.helpers import request


def _engine(pair, tokenizer, wait, fail_at=None, step_s=1.0, storage="dynamic"):
    """wait: in steps of step_s seconds (the clock advances step_s a step)."""
    small, large = pair_runners(pair, storage, fail_at)
    clock = (step_s * i for i in itertools.count(1)).__next__
    engine = BackoffEngine([small, large], tokenizer, catch_up_wait_ms=wait * step_s * 1e3, clock=clock)
    return engine, large


def test_a_routed_step_waits_for_the_oldest_to_reach_the_limit(pair, tokenizer):
    """Six requests, a wait of 2 steps. A is routed at step 2 and waits (1 of 6 waiting:
    under half); at step 4 one more step would take it past the limit, and B, routed then,
    rides along: ONE M_L forward for both. A's later tokens come 2 steps late; the others
    commit every step."""
    engine, large = _engine(pair, tokenizer, wait=2)
    scripts = {"A": [0, 1, 0, 0, 0], "B": [0, 0, 0, 1, 0], **{c: [0] * 5 for c in "CDEF"}}
    scripted(engine, scripts)
    steps = run_steps(engine)
    everyone = set(scripts)
    assert steps == [everyone, everyone - {"A"}, everyone - {"A"}, everyone, everyone, {"A"}, {"A"}]
    assert large.calls == [["A", "B"]]
    results = {rid: engine.finish(rid) for rid in scripts}
    assert {rid: list(r.sources) for rid, r in results.items()} == scripts
    a, b = results["A"].catch_ups[0], results["B"].catch_ups[0]
    assert (a.length, a.batch_size, b.length, b.batch_size) == (5, 2, 7, 2)  # prompt + pending, 2 rows


@pytest.mark.parametrize("storage", ["dynamic", "static"])
def test_the_same_tokens_as_catch_ups_at_once(pair, tokenizer, storage):
    """Sampled, random routing at 50%: every request's tokens and sources are those of
    catch-ups run in the step that routes them, with fewer M_L forwards (per-session caches
    and static KV slots, whose batches are bucketed)."""
    runs = {}
    for wait in (0, 3):
        engine, large = _engine(pair, tokenizer, wait, storage=storage)
        reqs = [request((3 + i, 4, 5), 24, "random", seed=i, temperature=1.0, rate=0.5) for i in range(8)]
        results = engine.generate_many(reqs)
        runs[wait] = ([(r.token_ids, r.sources) for r in results], len(large.calls))
    assert runs[3][0] == runs[0][0]
    assert 0 < sum(s.count(1) for _, s in runs[0][0])  # M_L was used
    assert runs[3][1] < runs[0][1]


def test_half_the_requests_waiting_catch_up_at_once(pair, tokenizer):
    """Four requests, wait 8: A waits alone (1 of 4); when B is routed too, half would
    wait, so both catch up in that step."""
    engine, large = _engine(pair, tokenizer, wait=8)
    scripts = {"A": [0, 1, 0, 0], "B": [0, 0, 1, 0], "C": [0] * 4, "D": [0] * 4}
    scripted(engine, scripts)
    steps = run_steps(engine)
    assert steps == [set("ABCD"), set("BCD"), set("ABCD"), set("ABCD"), {"A"}]
    assert large.calls == [["A", "B"]]


@pytest.mark.parametrize(("share", "calls"), [(None, [["A", "B", "C"]]), (1 / 3, [["A", "B"], ["C"]])])
def test_the_waits_end_at_max_share_of_the_live(pair, tokenizer, share, calls):
    """Six requests, wait 8: A, B and C routed at steps 2, 3 and 4. By default (half) the
    third makes half of them wait: one forward for the three. At a third (hold.max_share),
    B makes a third wait: A and B catch up at step 3, and C waits alone until it is all
    that is live."""
    engine, large = _engine(pair, tokenizer, wait=8)
    assert engine.hold.max_share == 0.5
    if share is not None:
        engine.hold.max_share = share
    scripts = {"A": [0, 1, 0, 0, 0], "B": [0, 0, 1, 0, 0], "C": [0, 0, 0, 1, 0], **{c: [0] * 5 for c in "DEF"}}
    scripted(engine, scripts)
    run_steps(engine)
    assert large.calls == calls
    assert {rid: list(engine.finish(rid).sources) for rid in scripts} == scripts


@pytest.mark.parametrize("n", [1, 2])
def test_a_lone_request_never_waits(pair, tokenizer, n):
    """With one or two requests, one waiting is half of them: every catch-up runs in the
    step that routes it, as with catch_up_wait_ms = 0."""
    engine, large = _engine(pair, tokenizer, wait=4)
    scripts = {f"r{i}": [0, 1, 1, 0, 1][i:] + [1] * i for i in range(n)}
    scripted(engine, scripts)
    steps = run_steps(engine)
    assert all(steps) and len(steps) == 5
    assert len(large.calls) == sum(s.count(1) for s in scripts.values()) - (n == 2) * 2  # r0 and r1 share two


def test_a_request_that_may_not_wait_takes_the_waiting_along(pair, tokenizer):
    """V verifies its drafts (it may not wait): its catch-up at step 3 runs anyway, and A,
    waiting since step 2, rides along rather than waiting out its 4 steps."""
    engine, large = _engine(pair, tokenizer, wait=4)
    plain = {"A": [0, 1, 0, 0], **{c: [0] * 4 for c in "CDEFG"}}
    scripted(engine, plain)
    scripted(engine, {"V": [0, 0, 1, 0]}, verification=Verification.KL, tolerance=1e9)
    steps = run_steps(engine)
    assert steps[1] == set("CDEFGV") and steps[2] == set("ACDEFGV")
    assert large.calls[0] == ["A", "V"]


def test_a_failed_batched_catch_up_commits_the_small_token(pair, tokenizer):
    """The forward A waited for gets no reply: A is degraded and its step takes M_S's token,
    drawn when A was routed, exactly as a failed catch-up at once does."""
    runs = {}
    for wait in (0, 2):
        engine, large = _engine(pair, tokenizer, wait, fail_at=1)
        scripted(engine, {"A": [0, 1, 1, 0], **{c: [0] * 4 for c in "CDEF"}})
        run_steps(engine)
        a = engine.finish("A")
        runs[wait] = (a.token_ids, a.sources, a.degraded, large.calls)
    assert runs[2][:3] == runs[0][:3]
    assert runs[2][1] == (0, 0, 0, 0) and runs[2][2]
    assert runs[2][3] == [["A"]]  # given up for good: no second call


def test_a_waiting_request_can_be_cancelled(pair, tokenizer):
    engine, large = _engine(pair, tokenizer, wait=4)
    scripted(engine, {"A": [0, 1, 0], **{c: [0] * 3 for c in "CDEF"}})
    engine.step()
    engine.step()  # A waits
    engine.cancel("A")
    steps = run_steps(engine)
    assert steps == [set("CDEF")]
    assert large.calls == []


@pytest.mark.parametrize(("step_ms", "waits"), [(9, 4), (15, 2), (50, 0)])
def test_the_wait_is_bounded_in_time(pair, tokenizer, step_ms, waits):
    """The default bound (40 ms) holds a routed token back as many steps as fit in it: none
    where a step takes longer (a CPU step of the default pair takes 100 ms or more)."""
    engine, large = _engine(pair, tokenizer, wait=CATCH_UP_WAIT_MS / step_ms, step_s=step_ms / 1e3)
    assert engine.catch_up_wait_ms == pytest.approx(CATCH_UP_WAIT_MS)
    scripted(engine, {"A": [0, 1, 0], **{c: [0] * 8 for c in "CDEF"}})
    steps = run_steps(engine)
    assert [("A" in got) for got in steps[: 4 + waits]] == [True] + [False] * waits + [True, True] + [False]
    assert large.calls == [["A"]]


def test_turned_off_between_steps_the_waiting_catch_up_at_once(pair, tokenizer):
    engine, large = _engine(pair, tokenizer, wait=4)
    scripted(engine, {"A": [0, 1, 0], **{c: [0] * 3 for c in "CDEF"}})
    engine.step()
    assert "A" not in engine.step()  # A waits
    engine.catch_up_wait_ms = 0
    assert "A" in engine.step()
    assert large.calls == [["A"]]


@pytest.mark.parametrize("wait", [-1, float("nan")])
def test_catch_up_wait_must_be_a_duration(pair, tokenizer, wait):
    with pytest.raises(ValueError, match="catch_up_wait_ms must be >= 0"):
        BackoffEngine([ModelRunner(pair[0], "small"), ModelRunner(pair[1], "large")], tokenizer, catch_up_wait_ms=wait)
