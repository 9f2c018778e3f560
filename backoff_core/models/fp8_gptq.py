"""fp8 weights chosen by GPTQ (Frantar et al. 2022) instead of rounding each to its nearest
e4m3 value (docs/fp8.md). An offline choice of the stored values only: the result is the
same format as `fp8.quantize_weight` (e4m3 [N, K], one float32 scale per 128 x 128 block,
the scales those of round-to-nearest: amax / 448 of the original block), so an FP8Linear runs
it through the same kernels (F.scaled_mm on the GPU, dequantised on the CPU) with the same
numbers. llm-compressor's GPTQModifier does the same for its fp8 schemes.

Why it helps. Rounding to nearest makes each weight's own error smallest; GPTQ makes the
layer's output error on real inputs smallest: with H = X^T X of the layer's calibration
inputs X [T, K], it rounds one input column at a time and moves the columns not yet rounded
to cancel that column's error along H (the optimal-brain-surgeon update, through the upper
Cholesky factor of H^-1). e4m3's 3-bit mantissa stays; where it lands is chosen against H.

The caller brings the calibration windows (benchmarks/fp8_quality.py: the corpus' train split,
never the held-out text the quality is measured on). Every layer's H comes from the
full-precision model in one pass (not layer by layer through the quantised ones).
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from backoff_core.models.fp8 import BLOCK, FP8, FP8_MAX, FP8Linear, decoder_linears, quantize_weight

ACT_ORDER = True  # GPTQ's desc_act: measured better here (docs/fp8.md)
DAMP = 0.01  # of H's mean diagonal, added to its diagonal: H of a few thousand tokens is near singular


@torch.no_grad()
def input_hessians(model: nn.Module, windows: torch.Tensor, batch: int = 8) -> dict[nn.Linear, torch.Tensor]:
    """H = X^T X [K, K] (float64) of every decoder linear's inputs over the windows [n, T]."""
    hessians: dict[nn.Linear, torch.Tensor] = {}

    def hook(layer, inputs, _output):
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()  # [tokens, K]
        hessians[layer] = hessians.get(layer, 0) + x.T @ x

    handles = [linear.register_forward_hook(hook) for _, _, linear in decoder_linears(model)]
    try:
        for start in tqdm(range(0, len(windows), batch), desc="GPTQ calibration", unit="batch"):
            model(windows[start : start + batch].to(model.device))
    finally:
        for handle in handles:
            handle.remove()
    return hessians


@torch.no_grad()
def gptq_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    block: tuple[int, int] = BLOCK,
    damp: float = DAMP,
    act_order: bool = ACT_ORDER,
    group: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K], H [K, K] -> (q [N, K] e4m3, scale [N/bn, K/bk] float32) as quantize_weight
    returns them, the scales quantize_weight's own; q chosen column by column (in `group`s, the
    update to later columns deferred to each group's end) to make ||X (W - q * s)^T|| small.
    act_order: the columns of largest H_ii (the inputs of most energy) first, while most columns
    are left to absorb their error (the scales stay those of the original blocks)."""
    n, k = weight.shape
    _, scale = quantize_weight(weight, block)
    bn, bk = block
    s_full = scale.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # [N, K]
    w = weight.double().clone()
    h = hessian.double().clone()
    dead = h.diagonal() == 0  # an input that is always 0: its column cannot matter
    h[dead, dead] = 1
    w[:, dead] = 0
    order = torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(k)
    w, s_full, h = w[:, order], s_full[:, order], h[order][:, order]
    h.diagonal().add_(damp * h.diagonal().mean())
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # H^-1 = U^T U
    q = torch.empty(n, k, dtype=FP8)
    for g0 in range(0, k, group):
        g1 = min(g0 + group, k)
        part, err = w[:, g0:g1].clone(), torch.empty(n, g1 - g0, dtype=torch.float64)
        for j in range(g1 - g0):
            col = g0 + j
            q[:, col] = (part[:, j] / s_full[:, col]).clamp(-FP8_MAX, FP8_MAX).float().to(FP8)
            err[:, j] = (part[:, j] - q[:, col].double() * s_full[:, col]) / u[col, col]
            part[:, j:] -= err[:, j : j + 1] * u[col, col:g1][None]
        w[:, g1:] -= err @ u[g0:g1, g1:]
    return q[:, torch.argsort(order)].contiguous(), scale


@torch.no_grad()
def gptq_quantize_model(
    model: nn.Module,
    windows: torch.Tensor,
    block: tuple[int, int] = BLOCK,
    activations: str = "auto",
    damp: float = DAMP,
    act_order: bool = ACT_ORDER,
) -> nn.Module:
    """Every decoder linear as an FP8Linear whose e4m3 values GPTQ chose on the calibration
    windows [n, T] (fp8.quantize_model's layout and kernels), in place; returns the model."""
    hessians = input_hessians(model, windows)
    for parent, name, linear in tqdm(decoder_linears(model), desc="GPTQ fp8", unit="linear"):
        q, scale = gptq_weight(linear.weight.cpu(), hessians.pop(linear).cpu(), block, damp, act_order)
        device = linear.weight.device
        setattr(parent, name, FP8Linear(q.to(device), scale.to(device), block, linear.bias, activations))
        linear.weight = None
    return model
