"""The CUDA tests' shared inputs: prompts, and two-layer models with the attention of the real
models (bf16 at G=3 and G=4), for test_static_cuda.py and test_static_ragged_cuda.py."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.support.tiny import VOCAB

PROMPTS = [(3, 4, 5, 6), (7,), (9, 9, 9, 9, 9, 9, 9, 1)]
LONG = tuple((5 * i + 1) % 48 for i in range(40))  # k = 40 > 16: an eager prefill

SHAPES = {  # G = heads / kv_heads; head_dim = hidden / heads
    "G3-135M": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536),
    "G4-8B": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=2048),
}


def shaped_model(shape: str, device: str = "cuda") -> LlamaForCausalLM:
    """Two layers with the attention of a real model (rope theta and all), random weights."""
    torch.manual_seed(11)
    config = LlamaConfig(
        vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=2048, tie_word_embeddings=False, **SHAPES[shape]
    )
    with torch.device(device):
        return LlamaForCausalLM(config).eval()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())
