"""The engine over static KV storage: the budget, the slot length, the fallback, sampling.

The runner itself is tested in test_static_runner.py; here, what a request sees: a request
that finds no free slot is refused with a retriable error and nothing leaks, a request
longer than a slot is refused up front, a model the static forward cannot run keeps
per-session caches, and seeded sampling gives the same tokens as the dynamic engine.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from backoff_core.engine.engine import BackoffEngine
from backoff_core.errors import KVCapacityError
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.factory import make_runner
from backoff_core.runners.static import StaticRunner
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams
from tests.support.tiny import TINY_SHAPE

PROMPT = (3, 4, 5, 6)


def _engine(pair, tokenizer, kv: KVSpec | None) -> BackoffEngine:
    small, large = pair
    return BackoffEngine([make_runner(small, "small", kv, small=True), make_runner(large, "large", kv)], tokenizer)


def _request(seed: int, max_tokens: int = 12, router: str = "random", **sampling) -> GenerationRequest:
    return GenerationRequest(
        PROMPT,
        SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True, **sampling),
        RoutingParams(router=router, rate=0.6),
    )


def test_no_free_slot_refuses_with_a_retriable_error_and_leaks_nothing(pair, tokenizer):
    engine = _engine(pair, tokenizer, KVSpec(budget_tokens=2 * 64, max_len=64))
    small, large = engine.models
    assert isinstance(small, StaticRunner) and isinstance(large, StaticRunner) and small.kv.slots == 2
    first, second = engine.submit(_request(1)), engine.submit(_request(2))
    with pytest.raises(KVCapacityError, match="kv_budget_tokens=128"):
        engine.submit(_request(3))
    assert sorted(small.request_ids()) == sorted([first, second]) and engine.live_ids() == [first, second]
    while engine.has_work():
        engine.step()
    results = [engine.finish(first), engine.finish(second)]
    assert small.request_ids() == [] and large.request_ids() == []
    request_id = engine.submit(_request(3))  # a slot is free again
    while engine.has_work():
        engine.step()
    results.append(engine.finish(request_id))
    dynamic = _engine(pair, tokenizer, None)
    assert [r.token_ids for r in results] == [dynamic.generate(_request(s)).token_ids for s in (1, 2, 3)]


def test_a_request_longer_than_a_slot_is_refused_up_front(pair, tokenizer):
    engine = _engine(pair, tokenizer, KVSpec(budget_tokens=256, max_len=32))
    assert engine.context_window == 31  # one position of each slot is scratch
    with pytest.raises(ValueError, match="context window of 31 tokens"):
        engine.submit(_request(0, max_tokens=28))
    assert engine.models[0].request_ids() == []
    assert len(engine.generate(_request(0, max_tokens=27)).token_ids) == 27  # 4 + 27 = 31 fits


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_seeded_sampling_equals_the_dynamic_engine_batched_or_alone(pair, tokenizer, temperature, top_p):
    reqs = [_request(seed, 16, temperature=temperature, top_p=top_p) for seed in range(5)]
    static = _engine(pair, tokenizer, KVSpec(budget_tokens=8 * 64, max_len=64)).generate_many(reqs)
    dynamic = _engine(pair, tokenizer, None)
    alone = [dynamic.generate(r) for r in reqs]
    assert [r.token_ids for r in static] == [r.token_ids for r in alone]
    assert [r.sources for r in static] == [r.sources for r in alone]
    assert len({r.token_ids for r in static}) > 1  # the seeds matter


def test_a_model_the_static_forward_cannot_run_keeps_per_session_caches(caplog):
    torch.manual_seed(0)
    config = Qwen3Config(**{**TINY_SHAPE, "head_dim": 8, "max_position_embeddings": 128})
    model = Qwen3ForCausalLM(config).eval()
    with caplog.at_level(logging.WARNING, logger="backoff_core.engine.engine"):
        runner = make_runner(model, "large", KVSpec(budget_tokens=256, max_len=64))
    assert type(runner) is ModelRunner
    assert "no static KV storage" in caplog.text and "qwen3" in caplog.text


def test_the_step_loop_refuses_a_request_without_a_slot_as_503_kv_capacity(pair, tokenizer):
    """Serving: the refusal is the request's alone, retriable (503), and names the budget."""
    pytest.importorskip("ray")  # deployments/ (scripts/image_check.sh runs these tests without it)
    from deployments.serving.engine_loop import EngineLoop
    from deployments.serving.outcomes import Admitted, Failed
    from deployments.streams import failure

    engine = _engine(pair, tokenizer, KVSpec(budget_tokens=64, max_len=64))  # one slot

    async def run():
        loop = EngineLoop(engine, lambda request, policy: request, policy=None)
        loop.start()
        try:
            first = loop.submit(_request(1, max_tokens=40))
            assert isinstance(await first.get(), Admitted)
            second = loop.submit(_request(2))
            refused = await asyncio.wait_for(second.get(), 30)
            items = [await asyncio.wait_for(first.get(), 30)]
            while not hasattr(items[-1], "token_ids") or hasattr(items[-1], "index"):
                items.append(await asyncio.wait_for(first.get(), 30))
            return refused, items[-1]
        finally:
            loop.stop()

    refused, result = asyncio.run(run())
    assert isinstance(refused, Failed) and refused.unavailable and refused.code == "kv_capacity"
    error = failure(refused)
    assert error.status == 503 and error.code == "kv_capacity" and "no free KV slot" in error.message
    assert len(result.token_ids) == 40  # the admitted request was not disturbed
    assert engine.models[0].request_ids() == []
