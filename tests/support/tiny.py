"""Tiny random-initialised models that share a tokenizer, built in-process (no files)."""

from __future__ import annotations

import pathlib

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 48
EOS = 0
# tiny_model's shape, for tests that build other architectures (Qwen2, Mistral, ...) at it
TINY_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def tiny_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(vocab - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


def tiny_model(
    seed: int, hidden: int = 32, layers: int = 2, sharpness: float = 1.0, vocab: int = VOCAB
) -> LlamaForCausalLM:
    """sharpness scales the LM head: > 1 makes distributions peaky (models disagree more)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=EOS,
        pad_token_id=EOS,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def tied_tiny() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """The tiny model with M_L's layout (LM head tied to the embedding) and its tokenizer:
    what the converted-model cache tests store and read back."""
    model = tiny_model(3)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    return model, tiny_tokenizer()


def slow_tied_tiny(marks: pathlib.Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """tied_tiny as a slow conversion that leaves one file in `marks` per call: two processes
    started together overlap in it, and the files count the conversions."""
    import os
    import time

    (marks / str(os.getpid())).touch()
    time.sleep(3)
    return tied_tiny()
