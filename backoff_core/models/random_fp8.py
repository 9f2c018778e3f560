"""Random-weight Llama models at real shapes, built layer by layer straight into fp8 (issue 53
item 4; docs/fp8.md): the paper's 70B-shaped M_L never exists as a whole bf16 copy (141 GB), so
it can be built on one H200 for speed measurements, where speed depends on shapes alone.

The model is made with its parameters on the meta device (fp8_checkpoint.empty_model; the
rotary tables real, on `device`), then each tensor is drawn on `device` in order: embeddings, each decoder
layer's linear weights (one dense matrix alive at a time, quantised at once with fp8.py's 128 x
128 blocks when `quantize` is fp8), norms (ones), LM head. One generator draws them all in that
order, so `quantize="none"` then fp8.quantize_model gives the same bytes (the test of it).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from backoff_core.models.fp8 import BLOCK, FP8Linear, check_quantize, quantize_weight
from backoff_core.models.fp8_checkpoint import empty_model

STD = 0.02  # LlamaConfig's initializer_range, as ../shared/gpu/make_pair.py draws its pair


def _draw(shape, device, dtype, generator) -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.empty(shape, device="meta", dtype=dtype)
    return (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * STD).to(dtype)


@torch.no_grad()
def random_model(
    config: LlamaConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    quantize: str = "fp8",
    seed: int = 0,
) -> LlamaForCausalLM:
    """A LlamaForCausalLM of `config` with random weights on `device` in eval mode; quantize
    fp8: the decoder's linear layers FP8Linear, each quantised right after it is drawn."""
    check_quantize(quantize)
    device = torch.device(device)
    generator = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
    model = empty_model(config, dtype, device)
    base = model.model
    base.embed_tokens.weight = nn.Parameter(_draw(base.embed_tokens.weight.shape, device, dtype, generator))
    for layer in base.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if not isinstance(linear, nn.Linear):
                    continue
                if linear.bias is not None:
                    raise ValueError(f"random_model draws Llama's tensors only; not drawn: {name}.bias")
                weight = _draw(linear.weight.shape, device, dtype, generator)  # [N, K]: the only dense copy
                if quantize == "fp8":
                    setattr(parent, name, FP8Linear(*quantize_weight(weight, BLOCK), BLOCK))
                else:
                    linear.weight = nn.Parameter(weight, requires_grad=False)
                del weight
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight = nn.Parameter(torch.ones(norm.weight.shape, device=device, dtype=dtype))
    base.norm.weight = nn.Parameter(torch.ones(base.norm.weight.shape, device=device, dtype=dtype))
    if config.tie_word_embeddings:
        model.lm_head.weight = base.embed_tokens.weight
    else:
        model.lm_head.weight = nn.Parameter(_draw(model.lm_head.weight.shape, device, dtype, generator))
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"] if device.type != "meta" else []
    if left:  # a module this builder does not know (biases, extra norms): refuse, naming it
        raise ValueError(f"random_model draws Llama's tensors only; not drawn: {left[:5]}")
    return model.requires_grad_(False).eval()
