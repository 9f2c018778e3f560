"""fp8 weights (backoff_core/models/fp8.py): the block format's error bounds, an fp8 model
against its full-precision self, the engine's tokens against plain transformers on the same
fp8 model, its memory, and the W8A8 GEMM's call as torch checks it (meta device)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backoff_core.engine.engine import BackoffEngine
from backoff_core.models.fp8 import (
    FP8,
    FP8_MAX,
    FP8Linear,
    _weight_scales_for_gemm,
    dequantize_weight,
    fake_quantize_activations,
    fp8_layers,
    keep_dequantized,
    linear_weight_bytes,
    quantize_activations,
    quantize_model,
    quantize_weight,
    set_activations,
    w8a8,
)
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.static import StaticRunner
from tests.support.helpers import hf_greedy, request
from tests.support.tiny import tiny_model

PROMPTS = [(3, 4, 5, 6), (9, 9, 9, 9, 9, 9, 9, 1)]


def _bound(w: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    """e4m3's rounding error: half an ulp of 3 mantissa bits (|w| / 16) for normal values,
    2^-10 of the block's scale for its subnormals (below 2^-6 in the scaled units)."""
    return torch.maximum(w.abs() / 16, scale_full * 2.0**-10) * (1 + 1e-6)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (64, 32)])
@pytest.mark.parametrize("block", [(128, 128), (1, 0), (0, 0)], ids=["block128", "channel", "tensor"])
def test_weight_round_trip_within_e4m3_rounding_per_block(shape, block):
    torch.manual_seed(0)
    n, k = shape
    block = (block[0] or n, block[1] or k)
    w = torch.randn(n, k) * torch.logspace(-3, 1, k)  # columns of very different sizes
    q, scale = quantize_weight(w, block)
    assert q.dtype == FP8 and q.shape == w.shape
    assert scale.shape == (-(-n // block[0]), -(-k // block[1])) and scale.dtype == torch.float32
    full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    err = (dequantize_weight(q, scale, block) - w).abs()
    assert (err <= _bound(w, full)).all()
    # each block's largest value maps onto e4m3's largest (the scale is that block's amax / 448)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            assert scale[i, j] == pytest.approx(part.abs().max().item() / FP8_MAX, rel=1e-6)
    # the blocks are independent: one huge value spoils only its own block's resolution
    spiked = w.clone()
    spiked[0, 0] = 1e4
    q2, scale2 = quantize_weight(spiked, block)
    if scale.numel() > 1:
        assert torch.equal(scale2.flatten()[1:], scale.flatten()[1:])


def test_activations_round_trip_per_1x128_block():
    torch.manual_seed(1)
    x = torch.randn(5, 300) * torch.logspace(-2, 2, 300)
    q, scale = quantize_activations(x, 128)
    assert q.shape == x.shape and scale.shape == (5, 3)
    full = scale.repeat_interleave(128, 1)[:, :300]
    back = fake_quantize_activations(x, 128)
    assert ((back - x).abs() <= _bound(x, full)).all()
    assert torch.equal(back, dequantize_weight(q, scale, (1, 128)))


def test_zero_blocks_stay_zero():
    w = torch.zeros(256, 256)
    w[:128, :128] = torch.randn(128, 128)
    q, scale = quantize_weight(w)
    back = dequantize_weight(q, scale, (128, 128))
    assert torch.isfinite(scale).all() and torch.equal(back[128:], w[128:]) and torch.equal(back[:, 128:], w[:, 128:])


def _model(seed=2, hidden=128, sharpness=1.0):
    return tiny_model(seed, hidden=hidden, layers=2, sharpness=sharpness)


def _quantized(model, activations="auto"):
    """An fp8 copy of model (the full one stays as it was)."""
    quantized = type(model)(model.config).eval()
    quantized.load_state_dict(model.state_dict())
    return quantize_model(quantized, activations=activations)


def test_only_the_decoders_linear_layers_are_fp8_and_take_a_byte_a_parameter():
    full = _model()
    fp8 = _quantized(full)
    layers = fp8_layers(fp8)
    assert len(layers) == 7 * full.config.num_hidden_layers  # q k v o gate up down
    assert all(layer.weight.dtype == FP8 and layer.weight.element_size() == 1 for layer in layers)
    assert type(fp8.lm_head) is torch.nn.Linear and fp8.lm_head.weight.dtype == torch.float32
    assert fp8.model.embed_tokens.weight.dtype == torch.float32 and fp8.model.norm.weight.dtype == torch.float32
    nbytes, params = linear_weight_bytes(fp8)
    full_bytes, full_params = linear_weight_bytes(full)
    assert params == full_params and nbytes == params == full_bytes // 4
    scales = sum(layer.weight_scale_inv.numel() * 4 for layer in layers)
    blocks = sum(-(-m.out_features // 128) * -(-m.in_features // 128) for m in layers)
    assert scales == 4 * blocks and scales < 0.002 * nbytes  # 4 bytes a block of up to 16 KiB of e4m3


def test_a_dtype_cast_keeps_fp8_weights_and_a_device_move_moves_them():
    fp8 = _quantized(_model())
    fp8.to(torch.bfloat16)
    layer = fp8_layers(fp8)[0]
    assert layer.weight.dtype == FP8 and layer.weight_scale_inv.dtype == torch.float32
    assert fp8.model.embed_tokens.weight.dtype == torch.bfloat16
    fp8.to("meta")
    assert layer.weight.device.type == "meta" and layer.weight.dtype == FP8


@pytest.mark.parametrize("activations", ["none", "fp8"])
def test_fp8_logits_close_to_the_full_models(activations):
    full = _model(sharpness=8.0)
    fp8 = _quantized(full, activations)
    ids = torch.tensor([[(7 * i + 3) % 48 for i in range(40)]])
    with torch.no_grad():
        a, b = full(ids).logits[0], fp8(ids).logits[0]
    # e4m3 leaves ~2.6% of a random weight's norm; two random layers carry that to the logits
    rel = ((a - b).norm() / a.norm()).item()
    assert 0 < rel < 0.1, rel  # not the same model, but close
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.85
    kl = F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert kl.mean() < 0.02


def test_weight_only_is_a_dense_model_of_the_dequantised_weights():
    """The CPU's weight-only fp8 computes exactly the model whose weights are q * scale."""
    full = _model()
    fp8 = _quantized(full, "none")
    dense = type(full)(full.config).eval()
    dense.load_state_dict(full.state_dict())
    names = dict(fp8.named_modules())
    with torch.no_grad():
        for name, module in dense.named_modules():
            if isinstance(names.get(name), FP8Linear):
                module.weight.copy_(names[name].dequantized())
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        torch.testing.assert_close(fp8(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("static", [False, True], ids=["sessions", "static"])
def test_engine_with_fp8_large_is_transformers_generate_of_the_same_fp8_model(tokenizer, static):
    small = tiny_model(1, sharpness=30)
    large = _quantized(_model(sharpness=30))  # blocks of 128: one or two a matrix
    if static:  # the static forward calls the FP8Linear modules (not fused, not compiled)
        runners = [
            StaticRunner(m, n, kv_budget_tokens=256, max_len=128) for m, n in ((small, "small"), (large, "large"))
        ]
    else:
        runners = [ModelRunner(small, "small"), ModelRunner(large, "large")]
    for prompt in PROMPTS:
        result = BackoffEngine(runners, tokenizer).generate(request(prompt, 12, "always-large"))
        assert result.token_ids == hf_greedy(large, prompt, 12)


@pytest.mark.parametrize("block", [(128, 128), (1, 512), (256, 512)], ids=["blockwise", "rowwise", "tensorwise"])
@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("api", ["scaled_mm", "_scaled_mm"])
def test_w8a8_call_passes_torchs_checks_of_scaled_mm(block, rows, api, monkeypatch):
    """The GEMM's operands as F.scaled_mm (or, in a torch without it, torch._scaled_mm) demands
    them (shapes, strides, dtypes): torch's own meta functions check them, so a layout the GPU
    would refuse fails here."""
    if api == "_scaled_mm":
        monkeypatch.delattr(F, "scaled_mm")
    q, scale = quantize_weight(torch.randn(256, 512), block)
    layer = FP8Linear(q, scale, block, torch.randn(256), activations="none").to("meta")
    layer._gemm_scales = _weight_scales_for_gemm(layer)
    out = w8a8(torch.randn(rows, 512, device="meta", dtype=torch.bfloat16), layer)
    assert out.shape == (rows, 256) and out.dtype == torch.bfloat16


def test_cpu_runs_dequantised_and_the_emulation_is_asked_for():
    fp8 = _quantized(_model())
    layer = fp8_layers(fp8)[0]
    assert layer.kernel == "dequantize" and layer.activations == "none"  # auto on the CPU: weight-only
    set_activations(fp8, "fp8")
    assert layer.kernel == "dequantize" and layer.activations == "fp8"  # W8A8's numbers, emulated


def test_bad_arguments_are_clear_errors():
    q, scale = quantize_weight(torch.randn(64, 64))
    with pytest.raises(ValueError, match="activations must be one of auto, fp8, none"):
        FP8Linear(q, scale, (128, 128), activations="int8")
    with pytest.raises(ValueError, match="weight must be"):
        FP8Linear(torch.randn(64, 64), scale, (128, 128))
    with pytest.raises(ValueError, match="do not cut"):
        FP8Linear(q, torch.ones(2, 2), (128, 128))


def test_keeping_the_dequantised_weights_changes_no_number():
    fp8 = _quantized(_model(), "fp8")
    ids = torch.tensor([[2, 7, 1, 8, 2, 8]])
    with torch.no_grad():
        each_forward = fp8(ids).logits
        kept = keep_dequantized(fp8)(ids).logits
    assert torch.equal(each_forward, kept) and fp8_layers(fp8)[0]._dense is not None
    assert keep_dequantized(fp8, None) is fp8 and fp8_layers(fp8)[0]._dense is None
