"""GPTQ-chosen fp8 weights (backoff_core/models/fp8_gptq.py): the same stored format and scales
as round-to-nearest, round-to-nearest itself where the inputs are uncorrelated, a smaller
output error where they are correlated, and a model whose FP8Linear layers run as fp8's."""

from __future__ import annotations

import pytest
import torch

from backoff_core.models.fp8 import FP8, FP8Linear, dequantize_weight, fp8_layers, quantize_model, quantize_weight
from backoff_core.models.fp8_gptq import gptq_quantize_model, gptq_weight
from tests.support.tiny import tiny_model


def _correlated_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """[tokens, K] drawn around a few strong shared directions (the same for every seed), as a
    decoder layer's inputs are."""
    basis = torch.randn(8, k, generator=torch.Generator().manual_seed(0)) * torch.logspace(1, -1, 8)[:, None]
    gen = torch.Generator().manual_seed(100 + seed)
    return torch.randn(tokens, 8, generator=gen) @ basis + 0.05 * torch.randn(tokens, k, generator=gen)


def test_scales_and_format_are_round_to_nearests():
    torch.manual_seed(0)
    w = torch.randn(256, 384)
    x = _correlated_inputs(2048, 384)
    q, scale = gptq_weight(w, x.double().T @ x.double())
    q0, scale0 = quantize_weight(w)
    assert q.dtype == FP8 and q.shape == w.shape
    assert torch.equal(scale, scale0)
    assert not torch.equal(q.float(), q0.float())  # it chose other values


@pytest.mark.parametrize("act_order", [False, True])
def test_uncorrelated_inputs_give_round_to_nearest(act_order):
    # H diagonal: no column's error can be cancelled by another's, so GPTQ rounds to nearest
    torch.manual_seed(1)
    w = torch.randn(128, 256)
    h = torch.diag(torch.rand(256, dtype=torch.float64) + 0.5)
    q, _ = gptq_weight(w, h, act_order=act_order)
    assert torch.equal(q.float(), quantize_weight(w)[0].float())


@pytest.mark.parametrize("act_order", [False, True])
def test_output_error_smaller_than_round_to_nearest_on_correlated_inputs(act_order):
    torch.manual_seed(2)
    w = torch.randn(256, 384) * 0.05
    calib, held_out = _correlated_inputs(4096, 384, seed=3), _correlated_inputs(1024, 384, seed=4)
    q, scale = gptq_weight(w, calib.double().T @ calib.double(), act_order=act_order)
    q0, scale0 = quantize_weight(w)

    def out_err(qq, ss):
        return ((held_out @ (w - dequantize_weight(qq, ss, (128, 128))).T).norm() / (held_out @ w.T).norm()).item()

    assert out_err(q, scale) < 0.7 * out_err(q0, scale0)


def test_a_gptq_model_is_fp8linear_layers_closer_to_the_full_model():
    full = tiny_model(5, hidden=128, layers=2).eval()
    gen = torch.Generator().manual_seed(6)
    calib, held_out = torch.randint(0, 48, (16, 32), generator=gen), torch.randint(0, 48, (4, 32), generator=gen)
    rtn = quantize_model(tiny_model(5, hidden=128, layers=2).eval(), activations="none")
    gptq = gptq_quantize_model(tiny_model(5, hidden=128, layers=2).eval(), calib, activations="none")
    layers = fp8_layers(gptq)
    assert len(layers) == len(fp8_layers(rtn)) == 2 * 7
    assert all(isinstance(m, FP8Linear) and m.weight.dtype == FP8 and m.kernel == "dequantize" for m in layers)
    with torch.no_grad():
        want = full(held_out).logits
        err = {name: (m(held_out).logits - want).norm().item() for name, m in (("rtn", rtn), ("gptq", gptq))}
    assert err["gptq"] < err["rtn"]
