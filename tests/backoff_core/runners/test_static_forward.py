"""StaticForward (backoff_core/runners/static_forward.py) one level below StaticRunner: a
hand-built Batch over StaticKV storage gives HF's own forward logits on the tiny llama
model in float32 -- a prefill, single-token decode steps at several positions, ragged
rows on the gather path -- with the modules' projections or fused ones (the same numbers,
fewer ops a layer), and check_supported refuses what it cannot compute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from backoff_core.runners.static_forward import FusedLayer, StaticForward, check_supported
from backoff_core.runners.static_kv import StaticKV
from tests.support.ops import Ops
from tests.support.static_batch import MAX_LEN, batch
from tests.support.tiny import TINY_SHAPE, VOCAB, tiny_model

TOL = dict(atol=1e-4, rtol=1e-4)
IDS = [3, 17, 4, 29, 5, 11, 40, 2, 8, 31, 7, 19]


@pytest.fixture(scope="module")
def model():
    return tiny_model(2, hidden=64, layers=4)  # 4 query heads over 2 kv heads: G = 2 folded


@pytest.fixture(params=[False, True], ids=["modules", "fused"])
def fuse(request) -> bool:
    return request.param


def forward(model, slots: int = 2, fuse: bool = False) -> StaticForward:
    return StaticForward(model, StaticKV(model, slots * MAX_LEN, MAX_LEN), fuse_projections=fuse)


def hf_logits(model, ids: list[int]) -> torch.Tensor:  # -> [len(ids), V]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def test_prefill_equals_hf_forward(model, fuse):
    logits, hidden = forward(model, fuse=fuse)(batch([IDS], [0], [0], length=16))
    assert logits.shape == (1, len(IDS), VOCAB) and logits.dtype == torch.float32 and hidden is None
    torch.testing.assert_close(logits[0], hf_logits(model, IDS), **TOL)


@torch.no_grad()
@pytest.mark.parametrize("slot", [0, 1], ids=["dense-view", "gathered-row"])
def test_single_token_steps_at_several_positions_equal_hf(model, slot, fuse):
    run = forward(model, fuse=fuse)
    run(batch([IDS[:4]], [0], [slot], length=4))
    for p in range(4, len(IDS)):  # the key length grows in buckets past the step's position
        logits, _ = run(batch([[IDS[p]]], [p], [slot], length=8 if p < 8 else 32))
        torch.testing.assert_close(logits[0, 0], hf_logits(model, IDS[: p + 1])[-1], **TOL)


@torch.no_grad()
def test_ragged_rows_last_only_read_each_rows_own_last_token(model, fuse):
    run = forward(model, slots=3, fuse=fuse)
    a, b = IDS[:7], IDS[5:8]
    logits, _ = run(batch([a, b], [0, 0], [2, 0], length=8, last_only=True))  # slots out of order: gather
    assert logits.shape == (2, 1, VOCAB)
    torch.testing.assert_close(logits[0, 0], hf_logits(model, a)[-1], **TOL)
    torch.testing.assert_close(logits[1, 0], hf_logits(model, b)[-1], **TOL)


@torch.no_grad()
@pytest.mark.parametrize("layer", [0, 2, 4])
def test_hidden_layer_is_hfs_hidden_state(model, layer, fuse):
    _, hidden = forward(model, fuse=fuse)(batch([IDS], [0], [0], length=16, hidden_layer=layer))
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


def _ops_per_layer(fuse: bool, dtype=torch.float32, norms=None) -> float:
    counts = []
    for layers in (2, 4):
        run = forward(tiny_model(2, hidden=64, layers=layers).to(dtype), fuse=fuse)
        if norms is not None:
            run.norm = norms.__get__(run)
        with torch.inference_mode(), Ops() as ops:  # as a capture runs it
            run(batch([[3], [5]], [4, 9], [0, 1], length=16, last_only=True))
        counts.append(ops.count)
    return (counts[1] - counts[0]) / 2


def _norm_with_casts(self, module, x):  # the former norm: float32 in, the cast back outside
    return module.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=module.variance_epsilon).to(x.dtype)


def test_fused_projections_and_norms_dispatch_fewer_ops_a_layer():
    # q/k/v: 3 GEMMs -> 1; gate/up: 2 -> 1; the rope over q and k at once, its negation
    # folded into sin once a forward: 10 -> 4
    assert (_ops_per_layer(False), _ops_per_layer(True)) == (28, 19)
    # bf16: the norms' two casts each (4 a layer) are gone too
    assert _ops_per_layer(False, torch.bfloat16, _norm_with_casts) == 32
    assert _ops_per_layer(True, torch.bfloat16) == 19


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fused_projections_give_the_modules_numbers_bit_for_bit(arch, dtype):
    # the same GEMM rows and the same elementwise formula: identical logits, not just close
    torch.manual_seed(4)
    shape = dict(TINY_SHAPE, hidden_size=64, num_hidden_layers=3)
    make = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**shape, mlp_bias=True, attention_bias=True)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**shape)),  # q/k/v biases
        "mistral": lambda: MistralForCausalLM(MistralConfig(**shape, sliding_window=None)),
    }[arch]
    model = make().eval().to(dtype)
    if arch != "mistral":  # HF initialises biases to zero: give them values that count
        for p in model.parameters():
            if p.dim() == 1 and not p.any():
                p.normal_()
    plain, fused = forward(model, slots=3), forward(model, slots=3, fuse=True)
    assert plain.fused is None and fused.fused is not None
    for rows, starts, slots, length in (([IDS], [0], [0], 16), ([[7], IDS[:5]], [12, 0], [0, 2], 16)):
        a = plain(batch(rows, starts, slots, length=length))[0]
        b = fused(batch(rows, starts, slots, length=length))[0]
        assert torch.equal(a, b)
    torch.testing.assert_close(
        fused(batch([IDS[:6]], [0], [1], length=8))[0][0].float(),
        model(torch.tensor([IDS[:6]])).logits[0].float(),
        **(TOL if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)),
    )


def test_fused_copies_are_counted_and_a_partial_bias_keeps_the_modules():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_SHAPE)).eval()
    run = forward(model, fuse=True)
    d, inner, kv_width = 32, 64, 2 * 32 // 4  # hidden, MLP width, kv_heads * head_dim
    assert run.fused_nbytes() == 2 * (d * (d + 2 * kv_width) + 2 * inner * d) * 4  # 2 layers, float32
    model.model.layers[1].self_attn.k_proj.bias = torch.nn.Parameter(torch.zeros(kv_width))  # k alone
    assert FusedLayer.of(model.model.layers[1]) is None
    assert forward(model, fuse=True).fused is None and forward(model, fuse=True).fused_nbytes() == 0


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_norm_is_hfs_rms_norm_bit_for_bit(dtype):
    # one F.rms_norm in the input's dtype (float32 inside) against LlamaRMSNorm's float32
    # normalisation, cast back, and weight product
    model = tiny_model(2, hidden=64, layers=1).to(dtype)
    norm = model.model.layers[0].input_layernorm
    torch.manual_seed(5)
    norm.weight.normal_()
    x = (torch.randn(3, 5, 64) * torch.logspace(-3, 3, 64)).to(dtype)
    run = forward(model)
    assert run.fused_norms
    got, want = run.norm(norm, x), norm(x)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)


def test_a_prefix_goes_in_and_out_of_a_slot_in_one_op_over_every_layer():
    # a prefix cache's hit writes every layer's K and V of a slot: one kernel, not two a layer
    model = tiny_model(2, hidden=64, layers=4)
    kv = StaticKV(model, 3 * MAX_LEN, MAX_LEN)
    block = torch.randn(4, 2, kv.kv_heads, 5, kv.head_dim)
    with Ops() as wrote:
        kv.write(1, block)
    with Ops() as read:
        out = kv.read(1, 0, 5)
    assert (wrote.count, read.count) == (1, 1)
    assert torch.equal(out, block) and out.is_contiguous()
    for layer in range(4):
        assert torch.equal(kv.keys[layer][1, :, :5], block[layer, 0])
        assert torch.equal(kv.values[layer][1, :, :5], block[layer, 1])
        assert not kv.keys[layer][[0, 2]].any() and not kv.keys[layer][1, :, 5:].any()  # nothing else
    out.zero_()  # a copy: the slot keeps its prefix
    assert torch.equal(kv.read(1, 2, 5), block[:, :, :, 2:])
    assert kv.nbytes() == 2 * 4 * 3 * kv.kv_heads * MAX_LEN * kv.head_dim * 4
