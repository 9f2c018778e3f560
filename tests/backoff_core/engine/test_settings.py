"""The live settings (engine/settings.py): each mode's step function is the one bound, and
rebound as the setting changes (plain -> in flight -> plain, plain -> ahead -> plain); a
refused change keeps the one bound; every binding's steps give the same tokens."""

from __future__ import annotations

import pytest

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.factory import make_runner
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams

KV = KVSpec(budget_tokens=8 * 64, max_len=64)


def _engine(pair, tokenizer, **kwargs) -> BackoffEngine:
    small, large = pair
    return BackoffEngine(
        [make_runner(small, "small", KV, small=True), make_runner(large, "large", KV)], tokenizer, **kwargs
    )


def _tokens(engine: BackoffEngine) -> list[tuple[int, ...]]:
    requests = [
        GenerationRequest(prompt, SamplingParams(max_tokens=8, seed=i), RoutingParams(router="random", rate=0.5))
        for i, prompt in enumerate([(3, 4, 5), (6, 7), (8, 9, 10, 11)])
    ]
    return [r.token_ids for r in engine.generate_many(requests)]


def test_the_step_function_bound_follows_the_setting(pair, tokenizer):
    engine = _engine(pair, tokenizer)
    assert engine._step_fn is BackoffEngine._step_plain
    plain = _tokens(engine)
    engine.overlap_catch_ups = True
    assert engine._step_fn is BackoffEngine._step_in_flight
    assert _tokens(engine) == plain
    with pytest.raises(ValueError, match="do not go together"):
        engine.launch_ahead = True
    assert engine._step_fn is BackoffEngine._step_in_flight  # refused: nothing rebound
    engine.overlap_catch_ups = False
    assert engine._step_fn is BackoffEngine._step_plain
    engine.launch_ahead = True
    assert engine._step_fn is BackoffEngine._step_ahead
    assert _tokens(engine) == plain
    engine.launch_ahead = False
    assert engine._step_fn is BackoffEngine._step_plain
    assert _tokens(engine) == plain


@pytest.mark.parametrize(
    "kwargs, bound",
    [
        ({}, BackoffEngine._step_plain),
        ({"overlap_catch_ups": True}, BackoffEngine._step_in_flight),
        ({"launch_ahead": True}, BackoffEngine._step_ahead),
    ],
)
def test_the_constructor_binds_the_step_of_its_mode(pair, tokenizer, kwargs, bound):
    assert _engine(pair, tokenizer, **kwargs)._step_fn is bound
