"""StaticRunner on a GPU with captured CUDA graphs (float32): equal to plain transformers
greedy decoding. Skipped where no GPU is present (`pytest -m cuda` selects these)."""

from __future__ import annotations

import pytest
import torch

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.static import KVCapacityError, StaticRunner
from backoff_core.types import Verification
from tests.support.helpers import request
from tests.support.tiny import tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPTS = [(3, 4, 5, 6), (7,), (9, 9, 9, 9, 9, 9, 9, 1)]
LONG = tuple((5 * i + 1) % 48 for i in range(40))  # k = 40 > 16: an eager prefill


def runner(model, name, slots=8, max_len=128) -> StaticRunner:
    run = StaticRunner(model, name, kv_budget_tokens=slots * max_len, max_len=max_len, cuda_graphs=True)
    graphs, _ = run.warmup(progress=False)
    assert graphs > 0 and run.graphs is not None
    return run


@pytest.fixture(scope="module")
def gpu_pair():
    return (tiny_model(1, sharpness=30).cuda().float(), tiny_model(2, hidden=64, layers=4, sharpness=30).cuda().float())


@pytest.fixture(scope="module")
def engine(gpu_pair, tokenizer):
    return BackoffEngine([runner(gpu_pair[0], "small"), runner(gpu_pair[1], "large")], tokenizer)


@torch.inference_mode()
def greedy(model, prompt, n) -> tuple[int, ...]:
    out = model.generate(
        torch.tensor([list(prompt)], device="cuda"),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return tuple(out[0, len(prompt) :].tolist())


@torch.inference_mode()
def full_logits(model, ids) -> torch.Tensor:
    """[len(ids), V] logits of a plain forward over the whole sequence (no cache)."""
    return model(torch.tensor([list(ids)], device="cuda")).logits[0].float()


@pytest.mark.parametrize("prompt", [*PROMPTS, LONG])
def test_always_small_and_always_large_are_greedy(engine, gpu_pair, prompt):
    replays = [m.forward_passes - m.eager_passes for m in engine.models]
    for router, model in (("always-small", gpu_pair[0]), ("always-large", gpu_pair[1])):
        assert engine.generate(request(prompt, 20, router)).token_ids == greedy(model, prompt, 20)
    assert all(m.forward_passes - m.eager_passes > r for m, r in zip(engine.models, replays))  # graphs ran


def test_mixed_routing_takes_each_token_from_its_source(engine, gpu_pair):
    for seed in (1, 2):
        result = engine.generate(request(PROMPTS[0], 24, "random", rate=0.5, seed=seed))
        assert 0 < sum(result.sources) < 24
        seq = list(PROMPTS[0])
        for token, source in zip(result.token_ids, result.sources):
            assert token == int(full_logits(gpu_pair[source], seq)[-1].argmax())
            seq.append(token)


@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_speculative_greedy_is_large_alone(engine, gpu_pair, draft_tokens):
    reqs = [request(p, 20, "draft", draft_tokens=draft_tokens, verification=Verification.EXACT) for p in PROMPTS]
    results = engine.generate_many(reqs)
    assert [r.token_ids for r in results] == [greedy(gpu_pair[1], p, 20) for p in PROMPTS]
    assert sum(r.rollbacks for r in results) > 0


def test_batched_equals_alone(engine):
    reqs = [request(p, 12, r, rate=0.5, seed=4) for p in PROMPTS for r in ("random", "always-small", "always-large")]
    alone = [engine.generate(r) for r in reqs]
    together = engine.generate_many(reqs)
    assert [a.token_ids for a in alone] == [t.token_ids for t in together]
    assert [a.sources for a in alone] == [t.sources for t in together]
    assert [m.request_ids() for m in engine.models] == [[], []]


def test_rollback_equals_recomputation(gpu_pair):
    model = gpu_pair[1]
    run = runner(model, "large")
    run.open("a")
    run.open("b")
    run.extend([("a", list(range(1, 30))), ("b", [2, 3])])
    run.crop("a", 12)
    got = run.extend([("a", [40, 41, 42]), ("b", [4])])  # ragged k = 3 and 1: a k=4 graph
    torch.testing.assert_close(
        got[0].logits, full_logits(model, list(range(1, 13)) + [40, 41, 42])[-3:], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(got[1].logits, full_logits(model, [2, 3, 4])[-1:], atol=1e-4, rtol=1e-4)


def test_kv_budget_and_slot_reuse(gpu_pair):
    model = gpu_pair[0]
    run = runner(model, "small", slots=2, max_len=64)
    run.open("a")
    run.open("b")
    with pytest.raises(KVCapacityError, match="kv_budget_tokens=128"):
        run.open("c")
    run.extend([("a", [5] * 40), ("b", [6])])
    with pytest.raises(KVCapacityError, match="limit of 63"):
        run.extend([("a", [1] * 24)])
    assert run.length("a") == 40
    run.close("a")
    run.open("c")  # a's slot, a's 40 keys still in it
    got = run.extend([("c", [1, 2, 3])])[0].logits
    torch.testing.assert_close(got, full_logits(model, [1, 2, 3]), atol=1e-4, rtol=1e-4)
