"""A tiny M_L for tensor parallelism tests: its 12 heads and 6 KV heads split over 2 and over
3 ranks (tiny.py's 4 and 2 do not split over 3); its head tied to the embedding as the default
pair's M_L is (the shard unties it: sharding.py)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.support.tiny import EOS, VOCAB


def tp_model(seed: int = 5, sharpness: float = 30.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(sharpness)  # tied head: peaky distributions
    return model
