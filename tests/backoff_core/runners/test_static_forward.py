"""StaticForward (backoff_core/runners/static_forward.py) one level below StaticRunner: a
hand-built Batch over StaticKV storage gives HF's own forward logits on the tiny llama
model in float32 -- a prefill, single-token decode steps at several positions, ragged
rows on the gather path -- and check_supported refuses what it cannot compute."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from backoff_core.runners.static_forward import Batch, StaticForward, check_supported
from backoff_core.runners.static_kv import StaticKV
from tests.support.tiny import TINY_SHAPE, VOCAB, tiny_model

TOL = dict(atol=1e-4, rtol=1e-4)
MAX_LEN = 64
IDS = [3, 17, 4, 29, 5, 11, 40, 2, 8, 31, 7, 19]


@pytest.fixture(scope="module")
def model():
    return tiny_model(2, hidden=64, layers=4)  # 4 query heads over 2 kv heads: G = 2 folded


def forward(model, slots: int = 2) -> StaticForward:
    return StaticForward(model, StaticKV(model, slots * MAX_LEN, MAX_LEN))


def batch(
    rows: list[list[int]], starts: list[int], slots: list[int], length: int, last_only=False, hidden_layer=None
) -> Batch:
    """Rows right-padded to the longest; padding goes to the scratch column (MAX_LEN - 1)."""
    k = max(map(len, rows))
    ids = torch.tensor([r + [0] * (k - len(r)) for r in rows])  # [B, K]
    pos = torch.tensor([[s + j if j < len(r) else MAX_LEN - 1 for j in range(k)] for r, s in zip(rows, starts)])
    return Batch(
        input_ids=ids,
        positions=pos,
        slots=torch.tensor(slots),
        last_col=torch.tensor([len(r) - 1 for r in rows]),
        length=length,
        dense=slots == list(range(len(slots))),
        last_only=last_only,
        hidden_layer=hidden_layer,
    )


def hf_logits(model, ids: list[int]) -> torch.Tensor:  # -> [len(ids), V]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def test_prefill_equals_hf_forward(model):
    logits, hidden = forward(model)(batch([IDS], [0], [0], length=16))
    assert logits.shape == (1, len(IDS), VOCAB) and logits.dtype == torch.float32 and hidden is None
    torch.testing.assert_close(logits[0], hf_logits(model, IDS), **TOL)


@torch.no_grad()
@pytest.mark.parametrize("slot", [0, 1], ids=["dense-view", "gathered-row"])
def test_single_token_steps_at_several_positions_equal_hf(model, slot):
    run = forward(model)
    run(batch([IDS[:4]], [0], [slot], length=4))
    for p in range(4, len(IDS)):  # the key length grows in buckets past the step's position
        logits, _ = run(batch([[IDS[p]]], [p], [slot], length=8 if p < 8 else 32))
        torch.testing.assert_close(logits[0, 0], hf_logits(model, IDS[: p + 1])[-1], **TOL)


@torch.no_grad()
def test_ragged_rows_last_only_read_each_rows_own_last_token(model):
    run = forward(model, slots=3)
    a, b = IDS[:7], IDS[5:8]
    logits, _ = run(batch([a, b], [0, 0], [2, 0], length=8, last_only=True))  # slots out of order: gather
    assert logits.shape == (2, 1, VOCAB)
    torch.testing.assert_close(logits[0, 0], hf_logits(model, a)[-1], **TOL)
    torch.testing.assert_close(logits[1, 0], hf_logits(model, b)[-1], **TOL)


@torch.no_grad()
@pytest.mark.parametrize("layer", [0, 2, 4])
def test_hidden_layer_is_hfs_hidden_state(model, layer):
    _, hidden = forward(model)(batch([IDS], [0], [0], length=16, hidden_layer=layer))
    expected = model(torch.tensor([IDS]), output_hidden_states=True).hidden_states[layer]
    torch.testing.assert_close(hidden, expected, **TOL)


def test_check_supported_accepts_llama_and_a_window_that_never_binds(model):
    check_supported(model, MAX_LEN)
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(**TINY_SHAPE, sliding_window=MAX_LEN))
    check_supported(mistral, MAX_LEN)
    with pytest.raises(ValueError, match="sliding window 64 < max_len 65"):
        check_supported(mistral, MAX_LEN + 1)


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4)), "model_type='gpt2'"),
        (
            lambda: LlamaForCausalLM(
                LlamaConfig(**TINY_SHAPE, rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0))
            ),
            "rope type 'dynamic'",
        ),
    ],
    ids=["gpt2", "dynamic-rope"],
)
def test_check_supported_raises_value_error_naming_the_reason(make, says):
    with pytest.raises(ValueError, match=says):
        check_supported(make(), MAX_LEN)
