"""Backoff decoding reduces to plain transformers generation where it must."""

from __future__ import annotations

import pytest

from backoff_core.types import Verification
from tests.support.helpers import engine_for, hf_greedy, request

PROMPTS = [(3, 4, 5, 6), (7,), (9, 9, 9, 9, 9, 9, 9, 1)]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_always_small_is_small_alone(pair, tokenizer, prompt):
    small, _ = pair
    result = engine_for(pair, tokenizer).generate(request(prompt, 20, "always-small"))
    assert result.token_ids == hf_greedy(small, prompt, 20)
    assert result.sources == (0,) * 20 and result.large_calls == 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_always_large_is_large_alone(pair, tokenizer, prompt):
    _, large = pair
    result = engine_for(pair, tokenizer).generate(request(prompt, 20, "always-large"))
    assert result.token_ids == hf_greedy(large, prompt, 20)
    assert result.sources == (1,) * 20


@pytest.mark.parametrize("prompt", PROMPTS)
def test_oracle_threshold_zero_is_large_alone(pair, tokenizer, prompt):
    _, large = pair
    result = engine_for(pair, tokenizer).generate(request(prompt, 20, "oracle", thresholds=(0.0,)))
    assert result.token_ids == hf_greedy(large, prompt, 20)
    assert result.backoff_rate == 0.0


def test_small_and_large_really_differ(pair, tokenizer):
    """Guards the tests above: with identical models they could not fail."""
    small, large = pair
    assert hf_greedy(small, PROMPTS[0], 20) != hf_greedy(large, PROMPTS[0], 20)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("draft_tokens", [1, 3, 5])
@pytest.mark.parametrize("max_tokens", [1, 7, 20])
@pytest.mark.parametrize("schedule", ["heuristic", "constant"])
def test_speculative_greedy_is_large_alone(pair, tokenizer, prompt, draft_tokens, max_tokens, schedule):
    _, large = pair
    result = engine_for(pair, tokenizer).generate(
        request(
            prompt,
            max_tokens,
            "draft",
            draft_tokens=draft_tokens,
            draft_schedule=schedule,
            verification=Verification.EXACT,
        )
    )
    assert result.token_ids == hf_greedy(large, prompt, max_tokens)


def test_draft_schedule_shrinks_after_rejections_and_constant_stays(pair, tokenizer):
    """The tiny pair rarely agrees: the heuristic falls to 1 draft; constant keeps K."""
    engine = engine_for(pair, tokenizer)
    kwargs = dict(draft_tokens=4, verification=Verification.EXACT)
    heuristic = engine.generate(request(PROMPTS[0], 30, "draft", **kwargs))
    constant = engine.generate(request(PROMPTS[0], 30, "draft", draft_schedule="constant", **kwargs))
    assert heuristic.rollbacks > 0 and heuristic.thresholds == (1.0,)
    assert constant.thresholds == (4.0,)
    # each verification of the constant schedule reads 4 drafts + the large model's own token
    assert [c.length for c in constant.catch_ups][1:] and all(
        c.length == 5 for c in constant.catch_ups[1:] if c.rolled_back == 0
    )


def test_kl_verification_tolerance_zero_is_large_alone(pair, tokenizer):
    _, large = pair
    result = engine_for(pair, tokenizer).generate(
        request(PROMPTS[0], 20, "entropy", thresholds=(1e9,), verification=Verification.KL, tolerance=0.0)
    )
    assert result.token_ids == hf_greedy(large, PROMPTS[0], 20)
    assert result.rollbacks > 0


def test_kl_verification_infinite_tolerance_is_pure_backoff(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    plain = engine.generate(request(PROMPTS[0], 20, "random", rate=0.6, seed=3))
    verified = engine.generate(request(PROMPTS[0], 20, "random", rate=0.6, seed=3, verification=Verification.KL))
    assert verified.token_ids == plain.token_ids and verified.rollbacks == 0


def test_chain_of_three_always_large_is_top_alone(chain3, tokenizer):
    result = engine_for(chain3, tokenizer).generate(request(PROMPTS[0], 15, "always-large"))
    assert result.token_ids == hf_greedy(chain3[-1], PROMPTS[0], 15)
    assert result.sources == (2,) * 15


def test_chain_of_three_speculative_is_top_alone(chain3, tokenizer):
    result = engine_for(chain3, tokenizer).generate(
        request(PROMPTS[0], 15, "draft", draft_tokens=3, verification=Verification.EXACT)
    )
    assert result.token_ids == hf_greedy(chain3[-1], PROMPTS[0], 15)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_steps_equal_each_request_alone(pair, tokenizer, temperature):
    engine = engine_for(pair, tokenizer)
    routers = [
        dict(router="draft", draft_tokens=3, verification=Verification.EXACT),
        dict(router="random", rate=0.5),
        dict(router="always-small"),
        dict(router="always-large"),
        dict(router="oracle", thresholds=(0.5,)),
        dict(router="entropy", thresholds=(1.0,)),
        dict(router="max-prob"),
    ]
    reqs = [request(p, 12, seed=5, temperature=temperature, **r) for p in PROMPTS for r in routers]
    alone = [engine.generate(r) for r in reqs]
    together = engine.generate_many(reqs)
    assert [a.token_ids for a in alone] == [t.token_ids for t in together]
    assert [a.sources for a in alone] == [t.sources for t in together]
    # the catch-ups of requests in the same step really were shared
    assert max(c.batch_size for t in together for c in t.catch_ups) > 1


def test_same_seed_same_output_different_seed_differs(soft_pair, tokenizer):
    engine = engine_for(soft_pair, tokenizer)
    runs = [engine.generate(request(PROMPTS[0], 24, "random", rate=0.5, seed=s, temperature=1.0)) for s in (1, 1, 2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].sources == runs[1].sources
    assert runs[0].token_ids != runs[2].token_ids


def test_sessions_are_freed(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    engine.generate_many([request(p, 5, "random", rate=0.5, seed=1) for p in PROMPTS])
    stream = engine.stream(request(PROMPTS[0], 50, "always-large"))
    next(stream)
    stream.close()  # the caller stops early: a cancel
    assert engine.models[0].request_ids() == [] and engine.models[1].request_ids() == []
