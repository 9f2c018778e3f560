"""fp8 weights for any model, chosen per model (docs/fp8.md): e4m3 weights with fine-grained
float32 scales, the decoder's linear layers only (embeddings, norms and the LM head keep the
model's dtype).

Format. A weight W [N, K] is cut into blocks of `block` = (bn, bk) elements (128 x 128, as
transformers' FineGrainedFP8Config and DeepSeek-V3 store it; (1, K) is per-channel, (N, K)
per-tensor: the compressed-tensors checkpoints, fp8_checkpoint.py). Each block keeps
s = amax(|block|) / 448 (float32, `weight_scale_inv`: the multiplier that dequantises) and
q = round_e4m3(W / s): W ~= q * s, |W - q * s| <= |W| / 16 (e4m3's 3 mantissa bits, half an ulp)
or s * 2^-10 for the block's subnormals. 1 byte a parameter, plus 4 bytes a block.

How a layer computes (`FP8Linear.kernel`, chosen once at quantisation):
- "scaled_mm" (W8A8: CUDA with fp8 tensor cores, compute capability >= 8.9): the activations
  are quantised at run time with one scale per 1 x bk block of a row (per token for a
  per-channel or per-tensor weight) and the GEMM runs in fp8 through PyTorch's own
  `F.scaled_mm` (cuBLAS's blockwise / rowwise scaled GEMM; `torch._scaled_mm` in a torch
  without it), output in the model's dtype. Probed once a device and block kind at load
  (`_probe`): a kernel that raises or misses the emulation below is not used (weight-only then,
  with a warning).
- "dequantize": the same stored weights dequantised on the fly to the input's dtype and a
  plain `F.linear` (the CPU; a GPU without fp8 tensor cores). With activations "fp8" the
  input is first quantised and dequantised exactly as the W8A8 GEMM reads it: the emulation
  that lets the CPU check the GPU's numbers (fp8_quality.py measures both).

Why our own and not a library's (docs/fp8.md): transformers' FP8Linear runs only through a
Triton kernel fetched from a model hub at first use (`kernels` package; no hub here nor on the
GPU machine) and has no CPU path; torchao is not installed on the GPU machine and cannot be.
PyTorch's scaled GEMM is in both torches we run.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

log = logging.getLogger(__name__)

QUANTIZE_MODES = ("none", "fp8")  # LoadSpec.quantize_small / quantize_large, the serve config's models.quantize
ACTIVATIONS = ("auto", "fp8", "none")  # auto: fp8 where the W8A8 kernel runs, none elsewhere
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = (128, 128)
_MIN_SCALE = 1e-12  # an all-zero block's scale: q = 0 either way, no division by zero


def check_quantize(mode: str, what: str = "quantize") -> str:
    """mode if it is one of QUANTIZE_MODES, else a ValueError naming them."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"{what} must be one of {', '.join(QUANTIZE_MODES)}, got {mode!r}")
    return mode


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _blocks(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """t [N, K] (float32) zero-padded to whole blocks, as [N/bn, bn, K/bk, bk]."""
    (n, k), (bn, bk) = t.shape, block
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    padded = F.pad(t, (0, kb * bk - k, 0, nb * bn - n)) if (n % bn or k % bk) else t
    return padded.view(nb, bn, kb, bk)


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] e4m3, scale [N/bn, K/bk] float32), W ~= q * scale blockwise.
    One float32 copy of this matrix at a time (a layer, never a model)."""
    n, k = weight.shape
    if weight.is_meta:  # shapes and dtypes only (benchmarks/gpu_plan.py): no arithmetic to trace
        scale = torch.empty(_cdiv(n, block[0]), _cdiv(k, block[1]), device="meta")
        return torch.empty(n, k, dtype=FP8, device="meta"), scale
    blocks = _blocks(weight.float(), block)  # [nb, bn, kb, bk]
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_MIN_SCALE)  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(q.shape[0] * q.shape[1], -1)[:n, :k].contiguous(), scale


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q [N, K] e4m3 with its block scales -> [N, K] in dtype (multiplied in float32)."""
    n, k = q.shape
    (bn, bk), (nb, kb) = block, scale.shape
    if n % bn == 0 and k % bk == 0:
        return (q.float().view(nb, bn, kb, bk) * scale[:, None, :, None]).view(n, k).to(dtype)
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # [N, K]
    return (q.float() * full).to(dtype)


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, K/block] float32): one scale per 1 x block of a row."""
    m, k = x.shape
    blocks = _blocks(x.float(), (1, block))  # [M, 1, kb, block]
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_MIN_SCALE)  # [M, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, -1)[:, :k], scale


def fake_quantize_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] as the W8A8 GEMM reads it: quantised per 1 x block and dequantised, in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    q, scale = quantize_activations(rows, block)
    return dequantize_weight(q, scale, (1, block), x.dtype).view(x.shape)


class FP8Linear(nn.Module):
    """y = x W^T + b with W stored in e4m3 and block scales (buffers: `model.to(dtype)` would
    cast a float8 parameter; these are moved by `.to(device)` alone, see `_apply`)."""

    def __init__(
        self,
        weight: torch.Tensor,  # [N, K] e4m3
        weight_scale_inv: torch.Tensor,  # [N/bn, K/bk] float32
        block: tuple[int, int],
        bias: torch.Tensor | None = None,
        activations: str = "auto",
    ) -> None:
        super().__init__()
        if weight.dtype != FP8:
            raise ValueError(f"FP8Linear's weight must be {FP8}, got {weight.dtype}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.out_features, self.in_features = weight.shape
        self.block = (int(block[0]), int(block[1]))
        if weight_scale_inv.shape != (_cdiv(weight.shape[0], block[0]), _cdiv(weight.shape[1], block[1])):
            raise ValueError(f"scales {tuple(weight_scale_inv.shape)} do not cut {tuple(weight.shape)} in {block}")
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", weight_scale_inv.float())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # the activations' block along K: the weight's, or the whole row (per token) for a weight
        # whose scale spans K (per-channel, per-tensor)
        self.activation_block = self.block[1] if self.block[1] < self.in_features else self.in_features
        self.activations = activations
        self.kernel = "dequantize"
        self._gemm_scales: torch.Tensor | None = None  # the weight's scales as F.scaled_mm reads them
        self._dense: torch.Tensor | None = None  # keep_dequantized's copy (the CPU's measurements only)
        self.choose_kernel()

    def choose_kernel(self) -> None:
        """Where the W8A8 GEMM runs on this device and shape (auto or fp8 activations), use it;
        otherwise dequantise (auto then means weight-only)."""
        wanted = self.activations in ("auto", "fp8")
        gemm = wanted and self.weight.device.type == "cuda" and scaled_mm_works(self.weight.device, self.recipe())
        gemm = gemm and self.in_features % 16 == 0 and self.out_features % 16 == 0
        if self.recipe() == "blockwise":
            gemm = gemm and self.in_features % 128 == 0 and self.out_features % 128 == 0
        self.kernel = "scaled_mm" if gemm else "dequantize"
        if self.activations == "auto":
            self.activations = "fp8" if gemm else "none"
        self._gemm_scales = _weight_scales_for_gemm(self) if gemm else None

    def recipe(self) -> str:
        """blockwise (128 x 128 weights, 1 x 128 activations), rowwise (per-channel weights,
        per-token activations) or tensorwise; another block shape runs dequantised."""
        if self.block == (128, 128):
            return "blockwise"
        if self.block == (1, self.in_features):
            return "rowwise"
        if self.block == (self.out_features, self.in_features):
            return "tensorwise"
        return "other"

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves the e4m3 weight and its scales; a dtype cast (`model.to(bf16)`)
        reaches the bias alone: the weight stays e4m3 and the scales float32 (never a cast copy)."""
        weight, scales = self._buffers.pop("weight"), self._buffers.pop("weight_scale_inv")
        try:
            super()._apply(fn, recurse)
        finally:
            device = fn(torch.empty(0, device=weight.device)).device
            self.register_buffer("weight", weight.to(device))
            self.register_buffer("weight_scale_inv", scales.to(device))
        if device != weight.device:
            self.choose_kernel()
        return self

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in dtype."""
        return dequantize_weight(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        if self.kernel == "scaled_mm":
            rows = x.reshape(-1, self.in_features)
            return w8a8(rows, self).view(*x.shape[:-1], self.out_features)
        if self.activations == "fp8":
            x = fake_quantize_activations(x, self.activation_block)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        dense = self._dense if self._dense is not None and self._dense.dtype == x.dtype else self.dequantized(x.dtype)
        return F.linear(x, dense, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
            f"kernel={self.kernel}, activations={self.activations}, bias={self.bias is not None}"
        )


def _weight_scales_for_gemm(layer: FP8Linear) -> torch.Tensor:
    """The weight's scales laid out as F.scaled_mm reads them for mat_b = W^T [K, N]."""
    scale = layer.weight_scale_inv  # [N/bn, K/bk]
    if layer.recipe() == "blockwise":
        # [L4, N/128], stride [1, L4], L4 = K/128 rounded up to 4 (torch's check for 1x128 x 128x128)
        kb = scale.shape[1]
        return F.pad(scale, (0, _cdiv(kb, 4) * 4 - kb)).contiguous().t()
    if layer.recipe() == "rowwise":
        return scale.reshape(1, -1).contiguous()  # [1, N]
    return scale.reshape(()).contiguous()  # tensorwise: one value


def w8a8(x: torch.Tensor, layer: FP8Linear) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: x quantised per 1 x activation_block, the fp8 GEMM
    (F.scaled_mm; torch._scaled_mm, its older form, in a torch without it)."""
    q, scale = quantize_activations(x, layer.activation_block)  # [M, K], [M, K/block]
    mat_b = layer.weight.t()  # [K, N], column-major as the GEMM wants it
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    recipe = layer.recipe()
    if recipe == "blockwise":
        scale_a = torch.empty_strided(scale.shape, (1, scale.shape[0]), device=x.device).copy_(scale)  # stride [1, M]
    elif recipe == "rowwise":
        scale_a = scale.contiguous()  # [M, 1]
    else:
        scale_a = scale.amax().reshape(())
        q = (x.float() / scale_a).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # one scale for the whole input
    if not hasattr(F, "scaled_mm"):
        scale_b = layer.weight_scale_inv.t() if recipe == "blockwise" else layer._gemm_scales  # [K/128, N/128]
        return torch._scaled_mm(q, mat_b, scale_a, scale_b, bias=bias, out_dtype=x.dtype)
    from torch.nn.functional import ScalingType

    kinds = {
        "blockwise": (ScalingType.BlockWise1x128, ScalingType.BlockWise128x128),
        "rowwise": (ScalingType.RowWise, ScalingType.RowWise),
    }.get(recipe, (ScalingType.TensorWise, ScalingType.TensorWise))
    return F.scaled_mm(q, mat_b, scale_a, kinds[0], layer._gemm_scales, kinds[1], bias=bias, output_dtype=x.dtype)


_PROBED: dict[tuple[str, str], bool] = {}


def scaled_mm_works(device: torch.device, recipe: str) -> bool:
    """Whether F.scaled_mm runs this recipe on this device and matches the emulation (once a
    device and recipe; a warning names why not)."""
    key = (str(device), recipe)
    if key not in _PROBED:
        _PROBED[key] = _probe(torch.device(device), recipe)
    return _PROBED[key]


def _probe(device: torch.device, recipe: str) -> bool:
    if recipe == "other" or device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device) < (8, 9):
        log.info("fp8: %s has no fp8 tensor cores: weight-only (dequantised) linear layers", device)
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = torch.randn(256, 512, generator=gen).to(device)
    block = {"blockwise": BLOCK, "rowwise": (1, 512), "tensorwise": (256, 512)}[recipe]
    layer = FP8Linear(*quantize_weight(weight, block), block, activations="none")
    layer.kernel, layer.activations = "scaled_mm", "fp8"
    layer._gemm_scales = _weight_scales_for_gemm(layer)
    try:
        for rows in (1, 17, 64):
            x = torch.randn(rows, 512, generator=gen).to(device=device, dtype=torch.bfloat16)
            got = w8a8(x, layer).float()
            want = F.linear(fake_quantize_activations(x.float(), layer.activation_block), layer.dequantized())
            err = ((got - want).norm() / want.norm()).item()
            if not err < 0.02:  # bf16 output of the same products
                raise RuntimeError(f"differs from the emulation by {err:.3g} at {rows} rows")
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel means: do not use it
        log.warning("fp8: F.scaled_mm (%s) unusable on %s (%s): weight-only linear layers", recipe, device, exc)
        return False
    return True


def decoder_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every nn.Linear inside the decoder layers: what fp8
    quantises (the LM head and the embeddings are not in model.model.layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers to quantise (a decoder-only LM is needed)")
    found = []
    for parent in layers.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                found.append((parent, name, child))
    return found


@torch.no_grad()
def quantize_model(
    model: nn.Module, block: tuple[int, int] = BLOCK, activations: str = "auto", progress: bool = False
) -> nn.Module:
    """Every linear layer of the decoder as an FP8Linear, in place, one layer at a time on its
    own device (its float32 copy is the only extra memory); returns the model."""
    for parent, name, linear in tqdm(decoder_linears(model), desc="fp8", unit="linear", disable=not progress):
        q, scale = quantize_weight(linear.weight, block)
        bias = None if linear.bias is None else linear.bias
        setattr(parent, name, FP8Linear(q, scale, block, bias, activations))
        linear.weight = None  # the dense copy goes now, not at the end
    return model


def set_activations(model: nn.Module, activations: str) -> nn.Module:
    """Every FP8Linear's activations ("fp8": W8A8 or its emulation, "none": weight-only, "auto")."""
    for module in model.modules():
        if isinstance(module, FP8Linear):
            module.activations = activations
            module.choose_kernel()
    return model


def keep_dequantized(model: nn.Module, dtype: torch.dtype | None = torch.float32) -> nn.Module:
    """Every FP8Linear keeps its dequantised weight in dtype (None: drops it), for measuring an
    fp8 model's numbers on the CPU fast: the same values as dequantising at every forward
    (e4m3 -> float32 is exact), at the dense model's memory. Serving never does this."""
    for layer in fp8_layers(model):
        layer._dense = None if dtype is None else layer.dequantized(dtype)
    return model


def fp8_layers(model: nn.Module) -> list[FP8Linear]:
    return [m for m in model.modules() if isinstance(m, FP8Linear)]


def linear_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes, parameters) of the decoder's linear weights, fp8 or not (scales excluded)."""
    layers = fp8_layers(model) or [m for _, _, m in decoder_linears(model)]
    return sum(m.weight.numel() * m.weight.element_size() for m in layers), sum(m.weight.numel() for m in layers)
