"""The feed plan of chunked prefill (engine/chunked.py), step by step: per model, the positions
its cache must hold (the target) against what it has fed; a request whose plan is open does
not step, and a long catch-up opens the plan of its level instead of running."""

from __future__ import annotations

from backoff_core.engine.engine import BackoffEngine
from backoff_core.engine.state import Live
from tests.support.helpers import engine_for, request

CHUNK = 8
LONG = tuple((7 * i + 3) % 40 + 2 for i in range(61))  # a head of 60 positions: 7 chunks of 8, then 4
NINE = LONG[:9]  # a head of 8: prefilled at admission, but M_L's first catch-up reads 9


def _engine(pair, tokenizer) -> BackoffEngine:
    return engine_for(pair, tokenizer, prefill_chunk_tokens=CHUNK, catch_up_wait_ms=0)


def _live(engine: BackoffEngine, request_id: str) -> Live:
    return engine._live[request_id]


def test_a_long_prompt_is_the_target_of_its_opened_levels_fed_a_chunk_per_step(pair, tokenizer):
    engine = _engine(pair, tokenizer)
    small_only, eager = engine.submit_many([request(LONG, 2), request(LONG, 2, eager_prefill=True)])
    a, b = _live(engine, small_only), _live(engine, eager)
    assert (a.plan, a.backlog, b.plan, b.backlog) == ([60, 0], {0: 60}, [60, 60], {0: 60, 1: 60})
    # one chunk a step per model, shared oldest first: `a` takes M_S's, `b` M_L's first
    assert engine.step() == {}
    assert (a.fed, b.fed) == ([8, 0], [0, 8])
    while a.plan:
        assert engine.step() == {} or not a.plan
    assert a.fed[0] == 61 and a.backlog == {} and a.stats.prefill_s > 0  # fed, then stepped at once
    assert len(a.generated) == 1 and b.plan and not b.generated  # M_S's chunks went to `a` first
    while b.plan:
        engine.step()
    assert b.backlog == {} and b.fed[1] == 60 and len(b.generated) == 1
    assert [m.request_ids() for m in engine.models] == [[small_only, eager], [eager]]


def test_a_forced_long_catch_up_opens_the_plan_before_m_s_steps(pair, tokenizer):
    engine = _engine(pair, tokenizer)
    r = _live(engine, engine.submit(request(NINE, 3, "always-large")))
    assert (r.plan, r.fed) == ([], [8, 0])  # the head prefilled at admission
    assert engine.step() == {}  # stage 1: 9 pending for M_L, 8 of them are its target
    assert (r.plan, r.backlog, r.fed, r.stats.small_times) == ([0, 8], {1: 8}, [8, 0], [])
    assert set(engine.step()) == {r.request_id}  # fed, then the catch-up reads the newest token
    assert r.plan == [] and r.fed[1] == 9 and [c.length for c in r.stats.catch_ups] == [1]


def test_a_routed_long_catch_up_opens_the_plan_and_m_s_steps_again(pair, tokenizer):
    engine = _engine(pair, tokenizer)
    r = _live(engine, engine.submit(request(NINE, 3, "random", seed=1, rate=0.0)))  # rate 0: always large
    assert engine.step() == {}  # stage 5: M_S's step undone, M_L's 8 positions are the target
    assert (r.plan, r.fed, r.stats.small_times, r.stats.router_times) == ([0, 8], [8, 0], [], [])
    assert set(engine.step()) == {r.request_id}  # fed, then the step taken again
    assert r.plan == [] and len(r.stats.small_times) == 1 and [c.length for c in r.stats.catch_ups] == [1]
