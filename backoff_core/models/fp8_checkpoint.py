"""Checkpoints published in fp8, loaded as they are (no round trip through bf16): the
compressed-tensors format of the public Llama-3.1-*-Instruct-FP8 releases.

Such a checkpoint's config.json carries `quantization_config` with quant_method
"compressed-tensors" and fp8 weights (`config_groups.*.weights`: num_bits 8, type float,
strategy "tensor", "channel" or "block"); each quantised Linear `x` stores `x.weight`
(float8_e4m3fn [N, K]) and `x.weight_scale` (the multiplier that dequantises: [1] or [] per
tensor, [N, 1] per channel, [N/bn, K/bk] per block), and `x.input_scale` where activations
were calibrated statically. Those become fp8.FP8Linear layers with the same scales: per
tensor is one block of (N, K), per channel blocks of (1, K). The model is built with its
parameters on the meta device (`empty_model`) and every tensor is assigned
straight from the files, so nothing is ever held at the model's full width. Static input
scales are dropped: activations are quantised per token at run time (dynamic), as the
releases' `input_activations` (strategy token, dynamic) ask.

transformers would load it only with the `compressed-tensors` package (not installed, here
or on the GPU machine), decompressing to bf16 where it cannot run fp8.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from backoff_core.models.fp8 import FP8, FP8Linear

QUANT_METHOD = "compressed-tensors"


def compressed_fp8_config(where: str | Path) -> dict | None:
    """The quantization_config of an fp8 compressed-tensors checkpoint directory, else None
    (a ValueError for a compressed-tensors checkpoint in a format other than fp8 weights)."""
    path = Path(where) / "config.json"
    if not path.is_file():
        return None
    qc = json.loads(path.read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != QUANT_METHOD:
        return None
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(
                f"{where}: compressed-tensors group {name!r} holds {weights.get('num_bits')}-bit "
                f"{weights.get('type')} weights; only fp8 (8-bit float) weights load here"
            )
        if weights.get("strategy") not in ("tensor", "channel", "block"):
            raise ValueError(f"{where}: compressed-tensors weight strategy {weights.get('strategy')!r} not supported")
    return qc


def block_structure(qc: dict) -> tuple[int, int] | None:
    """The weights' block_structure [bn, bk] of a quantization_config's block groups (None: not
    given, or groups that differ): the scales' shape alone cannot tell it where N or K is not a
    multiple of the block (576 / 5 blocks of 128 would read as blocks of 116)."""
    found = {
        tuple(w["block_structure"])
        for g in (qc.get("config_groups") or {}).values()
        if (w := g.get("weights") or {}).get("strategy") == "block" and w.get("block_structure")
    }
    return found.pop() if len(found) == 1 else None


def block_scales(
    weight_shape: torch.Size, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> tuple[tuple[int, int], torch.Tensor]:
    """A compressed-tensors weight_scale as (block, scales [N/bn, K/bk] float32); `block`: the
    config's block_structure, for scales per block."""
    n, k = weight_shape
    scale = scale.float()
    if scale.dim() == 2 and block is not None:  # the config's blocks (one may span the whole weight)
        bn, bk = block
        if scale.shape != (-(-n // bn), -(-k // bk)):
            raise ValueError(
                f"a weight_scale of shape {tuple(scale.shape)} does not cut {tuple(weight_shape)} in {block}"
            )
        return (bn, bk), scale
    if scale.numel() == 1:  # per tensor
        return (n, k), scale.reshape(1, 1)
    if scale.dim() == 2 and scale.shape == (n, 1):  # per channel
        return (1, k), scale
    if scale.dim() == 2:  # per block: [ceil(N/bn), ceil(K/bk)]
        rows, cols = scale.shape
        bn, bk = -(-n // rows), -(-k // cols)
        return (bn, bk), scale
    raise ValueError(f"a weight_scale of shape {tuple(scale.shape)} for a weight {tuple(weight_shape)}")


def _tensors(where: Path, device: str):
    """(name, tensor) of every safetensors file of the checkpoint, one at a time."""
    files = sorted(where.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{where}: no .safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def empty_model(config, dtype: torch.dtype, device: str | torch.device) -> PreTrainedModel:
    """config's causal LM with every parameter on the meta device (no memory, nothing drawn) and
    its rotary tables, the buffers no checkpoint holds, made on `device`."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, module in list(model.named_modules()):
        if "inv_freq" in module._buffers and hasattr(module, "config"):  # HF's *RotaryEmbedding(config)
            parent, _, attr = name.rpartition(".")
            with torch.device(device):
                tables = type(module)(module.config)
            setattr(model.get_submodule(parent) if parent else model, attr, tables)
    left = [n for n, b in model.named_buffers() if b.is_meta] if torch.device(device).type != "meta" else []
    if left:
        raise ValueError(f"{type(model).__name__}: buffers no checkpoint holds and none made here: {left[:5]}")
    return model


@torch.no_grad()
def load_compressed_fp8(where: str | Path, dtype: torch.dtype, device: str) -> PreTrainedModel:
    """The model of an fp8 compressed-tensors checkpoint, its quantised Linear layers as
    FP8Linear (weights e4m3 as stored), the rest in dtype, on device, in eval mode."""
    where = Path(where)
    config = AutoConfig.from_pretrained(where)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # transformers would ask for the compressed-tensors package
    configured = block_structure(compressed_fp8_config(where) or {})  # None: read from each scale
    model = empty_model(config, dtype, device)
    modules = dict(model.named_modules())
    tensors = dict(_tensors(where, device))
    for name in [n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")]:
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{where}: {name}.weight_scale belongs to no Linear layer of {type(model).__name__}")
        weight, scale = tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.weight_scale")
        tensors.pop(f"{name}.input_scale", None)
        if weight.dtype != FP8:
            raise ValueError(f"{where}: {name}.weight is {weight.dtype}, not {FP8}")
        block, scales = block_scales(weight.shape, scale, configured)
        bias = tensors.pop(f"{name}.bias", None)
        parent, _, attr = name.rpartition(".")
        layer = FP8Linear(weight, scales, block, None if bias is None else bias.to(dtype))
        setattr(modules[parent] if parent else model, attr, layer)
    rest = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"{where}: tensors the model has no place for: {unexpected[:5]}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise ValueError(f"{where}: no tensors in the checkpoint for {left[:5]}")
    return model.to(device).eval()
