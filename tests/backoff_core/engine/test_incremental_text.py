"""The incremental text (engine/incremental.py) is byte for byte the full decode: at every
step of random id streams with special and unknown ids, half characters and rollbacks, for
the two decoders it handles; other decoders keep decoding the whole text."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import backoff_core.engine.incremental as incremental
from backoff_core.engine.state import Detokenizer, Live
from backoff_core.routing.routers import AlwaysSmall
from backoff_core.types import GenerationRequest, SamplingParams


def _word_level() -> PreTrainedTokenizerFast:
    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.add_tokens([AddedToken("plain-added", special=False)])
    return fast


def _byte_level() -> PreTrainedTokenizerFast:
    """A small byte-level BPE whose merges cut multi-byte characters (é, 東, emoji) apart."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["héllo wörld 東京 and 🙂 more text, café naïve", "the quick brown fox 東 京 🙂🙂"] * 20
    tok.train_from_iterator(
        text, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})
    fast.add_tokens([AddedToken("<plain>", special=False)])
    return fast


def _live(prompt: list[int]) -> Live:
    request = GenerationRequest(tuple(prompt), SamplingParams(max_tokens=10_000))
    return Live(request, "r", AlwaysSmall(), (0.0,), 0, 2, tokens=list(prompt), fed=[0, 0])


@pytest.mark.parametrize("make, kind", [(_word_level, incremental.Joined), (_byte_level, incremental.Bytes)])
def test_every_step_matches_the_full_decode(make, kind):
    tokenizer = make()
    detok = Detokenizer(tokenizer)
    assert isinstance(detok.incremental, kind)
    full = Detokenizer(tokenizer)
    full.incremental = None  # the reference: the whole text decoded at every step
    vocab = len(tokenizer)
    rng = random.Random(0)
    for _stream in range(40):
        a, b = _live([3, 4]), _live([3, 4])
        for _ in range(rng.randrange(1, 60)):
            if rng.random() < 0.1 and len(a.tokens) > a.prompt_len + 1:  # a rollback
                keep = rng.randrange(a.prompt_len, len(a.tokens))
                a.truncate(keep), b.truncate(keep)
            token = rng.randrange(vocab + 3)  # an unknown id now and then
            a.tokens.append(token), b.tokens.append(token)
            assert detok.decoded(a) == full.decoded(b) == tokenizer.decode(b.generated, skip_special_tokens=True)
            assert detok.event(a, 0, 0) == full.event(b, 0, 0)
        a.finished = b.finished = "length"
        assert detok.full_text(a) == full.full_text(b)


def test_other_decoders_decode_the_whole_text():
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    assert Detokenizer(PreTrainedTokenizerFast(tokenizer_object=tok)).incremental is None
