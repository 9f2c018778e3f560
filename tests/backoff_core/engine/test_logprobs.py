"""Log-probabilities of committed tokens (backoff_core/engine/logprobs.py): each equals log_softmax of
its source model's logits recomputed with plain transformers over the whole sequence, the
top alternatives come sorted from the same distribution, and a verification rollback
retracts the entries of the tokens it drops."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from backoff_core.engine.logprobs import LOGPROB_FLOOR, TokenTexts, token_logprobs
from backoff_core.types import SamplingParams, Verification
from tests.support.helpers import engine_for, request

PROMPT = (3, 4, 5, 6)


def _asking(req, top_n: int, **sampling):
    return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, logprobs=top_n, **sampling))


def _recomputed(models, prompt, result) -> torch.Tensor:
    """[n, V] log_softmax of each generated token's source model over the whole sequence."""
    ids = torch.tensor([list(prompt) + list(result.token_ids)])
    with torch.no_grad():
        per_model = [torch.log_softmax(m(ids).logits[0].float(), -1) for m in models]  # [T, V] each
    n, p = len(result.token_ids), len(prompt)
    return torch.stack([per_model[s][p - 1 + i] for i, s in zip(range(n), result.sources)])


def _check_against(models, prompt, result, top_n: int) -> None:
    expected = _recomputed(models, prompt, result)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for i, (entry, token) in enumerate(zip(result.logprobs, result.token_ids)):
        assert entry.chosen.token_id == token
        assert entry.chosen.logprob == pytest.approx(float(expected[i, token]), abs=1e-4)
        values = [t.logprob for t in entry.top]
        assert len(entry.top) == top_n and values == sorted(values, reverse=True)
        want = torch.topk(expected[i], top_n)
        assert values == pytest.approx(want.values.tolist(), abs=1e-4)
        assert {t.token_id for t in entry.top} == set(want.indices.tolist())
        # the committed token, where it is among the top, carries the same value there
        for t in entry.top:
            if t.token_id == token:
                assert t.logprob == entry.chosen.logprob


@pytest.mark.parametrize(
    "router, kwargs, sources",
    [("always-small", {}, {0}), ("always-large", {}, {1}), ("entropy", {"thresholds": (0.4,)}, {0, 1})],
)
def test_logprob_is_the_source_models_raw_distribution(pair, tokenizer, router, kwargs, sources):
    result = engine_for(pair, tokenizer).generate(_asking(request(PROMPT, 20, router, **kwargs), 3))
    assert set(result.sources) == sources  # the mixed run really mixes
    _check_against(pair, PROMPT, result, 3)


def test_a_chain_of_three_reports_each_level(chain3, tokenizer):
    result = engine_for(chain3, tokenizer).generate(
        _asking(request(PROMPT, 24, "random", seed=5, thresholds=(0.4, 0.7)), 2)
    )
    assert set(result.sources) == {0, 1, 2}
    _check_against(chain3, PROMPT, result, 2)


def test_sampling_knobs_do_not_change_the_reported_distribution(pair, tokenizer):
    """Temperature and top-k shape the draw, not the report: the raw distribution at T = 1."""
    req = _asking(request(PROMPT, 12, "entropy", seed=3, temperature=1.7, thresholds=(0.4,)), 5, top_k=2)
    result = engine_for(pair, tokenizer).generate(req)
    _check_against(pair, PROMPT, result, 5)
    # top-k = 2 drew every token from the two most likely of its source's distribution
    assert all(e.chosen.token_id in {t.token_id for t in e.top[:2]} for e in result.logprobs)


def test_rollback_retracts_the_entries_of_the_dropped_tokens(pair, tokenizer):
    req = _asking(request(PROMPT, 20, "entropy", thresholds=(1e9,), verification=Verification.KL, tolerance=10.0), 1)
    engine = engine_for(pair, tokenizer)
    seen = []  # what a streaming client keeps: entries, minus the retracted ones
    for event in engine.stream(req):
        if event.retracted:
            del seen[-event.retracted :]
        seen.append(event.logprobs)
    result = engine.generate(req)
    assert result.rollbacks > 0 and set(result.sources) == {0, 1}
    assert tuple(seen) == result.logprobs
    assert [e.chosen.token_id for e in seen] == list(result.token_ids)
    _check_against(pair, PROMPT, result, 1)


def test_not_asking_costs_nothing_and_reports_none(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    req = request(PROMPT, 6, "entropy", thresholds=(0.4,))
    assert engine.generate(req).logprobs is None
    assert all(e.logprobs is None for e in engine.stream(req))
    zero = engine.generate(_asking(req, 0))
    assert all(e.top == () for e in zero.logprobs) and len(zero.logprobs) == 6


def test_text_offsets_follow_the_generated_text(pair, tokenizer):
    result = engine_for(pair, tokenizer).generate(_asking(request(PROMPT, 8, "always-large"), 0))
    offsets = [e.text_offset for e in result.logprobs]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for e, nxt in zip(result.logprobs, offsets[1:] + [len(result.text)]):
        assert result.text[e.text_offset : nxt].strip() == e.chosen.token  # the tiny tokenizer joins words with spaces


def test_minus_infinity_is_clamped_to_a_finite_floor(tokenizer):
    logits = torch.tensor([0.0, float("-inf"), float("nan"), -1e30] + [0.0] * 44)
    entry = token_logprobs(logits, 1, 48, TokenTexts(tokenizer), 0)
    assert entry.chosen.logprob == LOGPROB_FLOOR
    assert all(math.isfinite(t.logprob) and t.logprob >= LOGPROB_FLOOR for t in entry.top)
    assert entry.top[0].logprob == pytest.approx(math.log(1 / 45), abs=1e-5)


def test_byte_level_tokens_give_their_raw_bytes():
    """A character split over byte-level tokens: exact bytes, and \\xNN escapes as text."""
    alphabet = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=alphabet, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    texts = TokenTexts(hf)
    ids = hf.encode(" é", add_special_tokens=False)
    assert [texts(i)[1] for i in ids] == [b" ", b"\xc3", b"\xa9"]
    assert [texts(i)[0] for i in ids] == [" ", "\\xc3", "\\xa9"]


def test_word_level_tokens_are_their_vocabulary_entries(tokenizer):
    assert TokenTexts(tokenizer)(5) == ("w3", b"w3")


def test_sampling_params_bound_the_alternatives():
    assert SamplingParams(logprobs=20).logprobs == 20
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
