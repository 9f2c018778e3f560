"""A larger model that cannot answer in time (backends.LargeUnavailable) degrades its
requests to M_S alone, in process: a fake backend over the tiny large model fails on
purpose. Tiny models, no Ray."""

from __future__ import annotations

import pytest

from backoff_core.engine.engine import BackoffEngine
from backoff_core.errors import LargeUnavailable
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams, Verification
from tests.support.failing import Failing
from tests.support.helpers import hf_greedy, request


def _engine(pair, tokenizer, large: Failing) -> BackoffEngine:
    return BackoffEngine([ModelRunner(pair[0], "small"), large], tokenizer)


def _always_large(prompt, n, on_large_failure="degrade", request_id=""):
    return GenerationRequest(
        tuple(prompt),
        SamplingParams(max_tokens=n, ignore_eos=True),
        RoutingParams(router="always-large", on_large_failure=on_large_failure),
        request_id,
    )


def test_a_failed_catch_up_degrades_the_rest_to_the_small_model(pair, tokenizer):
    small, large_model = pair
    large = Failing(large_model, after=5)
    prompt, n = [3, 4, 5], 16
    result = _engine(pair, tokenizer, large).generate(_always_large(prompt, n))
    assert result.degraded and "no reply" in result.degraded_reason
    assert result.sources == (1,) * 5 + (0,) * (n - 5)  # M_L's five tokens, then M_S only
    assert result.token_ids[:5] == hf_greedy(large_model, prompt, 5)
    # M_S goes on from the committed text (its cache caught up over the large tokens)
    assert result.token_ids[5:] == hf_greedy(small, prompt + list(result.token_ids[:5]), n - 5)
    assert len(large.calls) == 6 and large.request_ids() == []  # never called again, session closed


def test_fail_policy_ends_the_request_with_the_error(pair, tokenizer):
    large = Failing(pair[1], after=2)
    engine = _engine(pair, tokenizer, large)
    with pytest.raises(LargeUnavailable, match="no reply"):
        engine.generate(_always_large([3, 4], 12, on_large_failure="fail"))
    assert engine.live_ids() == [] and large.request_ids() == []
    with pytest.raises(LargeUnavailable):
        list(engine.stream(_always_large([3, 4], 12, on_large_failure="fail")))
    assert engine.live_ids() == []


def test_only_the_sessions_without_a_reply_degrade(pair, tokenizer):
    large = Failing(pair[1], after=3, dead={"b"})
    engine = _engine(pair, tokenizer, large)
    a, b = engine.generate_many(
        [_always_large([3, 4, 5], 10, request_id="a"), _always_large([6, 7], 10, request_id="b")]
    )
    assert not a.degraded and a.sources == (1,) * 10
    assert b.degraded and b.sources == (1,) * 3 + (0,) * 7
    assert large.request_ids() == []


@pytest.mark.parametrize(
    "routing",
    [
        dict(router="entropy", thresholds=(0.3,)),
        dict(router="oracle", thresholds=(0.0,)),  # needs M_L's logits before it decides
        dict(router="draft", draft_tokens=3, verification=Verification.EXACT),  # speculative: verify steps
    ],
)
def test_every_router_degrades_without_hanging(pair, tokenizer, routing):
    large = Failing(pair[1], after=2)
    engine = _engine(pair, tokenizer, large)
    req = request([3, 4, 5], max_tokens=20, seed=1, temperature=0.8, **routing)
    result = engine.generate(req)
    assert result.degraded and len(result.token_ids) == 20 and 0 in result.sources
    assert len(large.calls) == 3 and engine.live_ids() == [] and large.request_ids() == []
    last_large = max((i for i, s in enumerate(result.sources) if s == 1), default=-1)
    assert all(s == 0 for s in result.sources[last_large + 1 :])


def test_a_healthy_large_model_is_not_degraded(pair, tokenizer):
    large = Failing(pair[1], after=10**6)
    result = _engine(pair, tokenizer, large).generate(_always_large([3, 4], 8))
    assert not result.degraded and result.degraded_reason == "" and result.sources == (1,) * 8
