"""EOS, stop strings, max tokens, streaming text, and input validation of the engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backoff_core.types import FinishReason, GenerationRequest, RoutingParams, SamplingParams, Verification
from tests.support.helpers import engine_for, hf_greedy, penalized_greedy, request

PROMPT = (3, 4, 5, 6)


def test_eos_stops_generation(pair, tokenizer):
    _, large = pair
    full = hf_greedy(large, PROMPT, 12)
    engine = engine_for(pair, tokenizer)
    engine.eos_ids = frozenset({full[5]})  # make the 6th greedy token the end of sequence
    req = GenerationRequest(PROMPT, SamplingParams(max_tokens=12), RoutingParams(router="always-large"))
    result = engine.generate(req)
    assert result.token_ids == full[: full.index(full[5]) + 1]
    assert result.finish_reason == FinishReason.STOP


@pytest.mark.parametrize(
    "routing",
    [
        dict(router="always-large"),
        dict(router="random", rate=0.5),
        dict(router="random", rate=0.6, verification=Verification.KL, tolerance=0.3),  # drafts await verification
    ],
)
def test_a_stop_token_id_ends_the_request_at_its_first_occurrence_even_with_ignore_eos(pair, tokenizer, routing):
    engine = engine_for(pair, tokenizer)
    plain = engine.generate(request(PROMPT, 16, seed=3, **routing))  # ignore_eos=True
    ids = plain.token_ids
    i = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # a token not seen before it
    sampling = SamplingParams(max_tokens=16, seed=3, ignore_eos=True, stop_token_ids=(ids[i],))
    result = engine.generate(GenerationRequest(PROMPT, sampling, RoutingParams(**routing)))
    # the plain run up to the stop token, which it keeps (its text too, as EOS's would be)
    assert result.token_ids == ids[: i + 1] and result.finish_reason == FinishReason.STOP
    assert result.text == engine.generate(request(PROMPT, i + 1, seed=3, **routing)).text


def test_stop_token_ids_outside_the_vocabulary_are_refused(pair, tokenizer):
    sampling = SamplingParams(max_tokens=4, stop_token_ids=(10**6,))
    with pytest.raises(ValueError, match="stop_token_ids must be in"):
        engine_for(pair, tokenizer).generate(GenerationRequest(PROMPT, sampling, RoutingParams(router="always-small")))


def test_min_tokens_is_transformers_min_new_tokens_under_always_large(pair, tokenizer):
    _, large = pair
    full = hf_greedy(large, PROMPT, 12)
    eos = full[2]
    engine = engine_for(pair, tokenizer)
    engine.eos_ids = frozenset({eos})
    sampling = SamplingParams(max_tokens=12, min_tokens=6)
    result = engine.generate(GenerationRequest(PROMPT, sampling, RoutingParams(router="always-large")))
    out = large.generate(
        torch.tensor([list(PROMPT)]),
        max_new_tokens=12,
        min_new_tokens=6,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    assert result.token_ids == tuple(out[0, len(PROMPT) :].tolist())
    assert eos not in result.token_ids[:6] and result.token_ids[:2] == full[:2]
    plain = engine.generate(
        GenerationRequest(PROMPT, SamplingParams(max_tokens=12), RoutingParams(router="always-large"))
    )
    assert plain.token_ids == full[:3]  # without min_tokens it ends at the third


@pytest.mark.parametrize(
    "routing",
    [dict(router="random", rate=0.5), dict(router="random", rate=0.6, verification=Verification.EXACT, draft_tokens=2)],
)
def test_min_tokens_bans_eos_and_stop_ids_at_every_level_until_reached(pair, tokenizer, routing):
    engine = engine_for(pair, tokenizer)
    runs = [engine.generate(request(PROMPT, 10, seed=s, temperature=1.0, **routing)) for s in range(40)]
    firsts = [t for r in runs for t in r.token_ids[:4]]
    eos, stop_id = sorted(set(firsts), key=firsts.count)[-2:]  # the two tokens the runs draw most early
    engine.eos_ids = frozenset({eos})
    sampling = SamplingParams(max_tokens=10, temperature=1.0, min_tokens=4, stop_token_ids=(stop_id,))
    ended_early = 0
    for s in range(40):
        sampled = dataclasses.replace(sampling, seed=s)
        result = engine.generate(GenerationRequest(PROMPT, sampled, RoutingParams(**routing)))
        assert len(result.token_ids) >= 4 and not {eos, stop_id} & set(result.token_ids[:4]), result.token_ids
        ended_early += result.finish_reason == FinishReason.STOP
    assert ended_early  # they do end the request once min_tokens is reached


def test_min_tokens_holds_stop_strings_back_and_must_not_pass_max_tokens(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    plain = engine.generate(request(PROMPT, 12, "always-large"))
    stop = plain.text.split()[1]
    first = plain.text.index(stop)
    for min_tokens in (6, 12):  # a stop string within the first min_tokens' text never ends the request
        held = SamplingParams(max_tokens=12, stop=(stop,), min_tokens=min_tokens, ignore_eos=True)
        result = engine.generate(GenerationRequest(PROMPT, held, RoutingParams(router="always-large")))
        head = engine.generate(request(PROMPT, min_tokens, "always-large")).text
        later = plain.text.find(stop, len(head) - len(stop) + 1)  # one that ends past them does
        assert first < len(head)
        if later < 0:
            assert result.token_ids == plain.token_ids and result.finish_reason == FinishReason.LENGTH
        else:
            assert result.text == plain.text[:later] and result.finish_reason == FinishReason.STOP
    with pytest.raises(ValueError, match="min_tokens must be in"):
        SamplingParams(max_tokens=3, min_tokens=4)


@pytest.mark.parametrize("level, router", [(0, "always-small"), (1, "always-large")])
@pytest.mark.parametrize(
    "penalties", [dict(repetition=1.5), dict(presence=1.5), dict(frequency=1.5), dict(presence=0.5, repetition=1.3)]
)
def test_penalties_are_vllms_over_plain_transformers(pair, tokenizer, level, router, penalties):
    model = pair[level]
    want = penalized_greedy(model, PROMPT, 14, **penalties)
    assert want != hf_greedy(model, PROMPT, 14)  # the penalties change this run
    sampling = SamplingParams(
        max_tokens=14,
        ignore_eos=True,
        presence_penalty=penalties.get("presence", 0.0),
        frequency_penalty=penalties.get("frequency", 0.0),
        repetition_penalty=penalties.get("repetition", 1.0),
    )
    result = engine_for(pair, tokenizer).generate(GenerationRequest(PROMPT, sampling, RoutingParams(router=router)))
    assert result.token_ids == want


def test_stop_string_cuts_text(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    plain = engine.generate(request(PROMPT, 12, "always-large"))
    words = plain.text.split()
    stop = words[4]
    first = plain.text.index(stop)
    req = GenerationRequest(PROMPT, SamplingParams(max_tokens=12, stop=(stop,)), RoutingParams(router="always-large"))
    result = engine.generate(req)
    assert result.text == plain.text[:first]
    assert result.finish_reason == FinishReason.STOP
    assert len(result.token_ids) < 12


def test_max_tokens_finishes_with_length(pair, tokenizer):
    result = engine_for(pair, tokenizer).generate(request(PROMPT, 7, "random", rate=0.5, seed=1))
    assert len(result.token_ids) == 7 and result.finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize(
    "routing",
    [dict(router="random", rate=0.5), dict(router="random", rate=0.6, verification=Verification.KL, tolerance=0.3)],
)
def test_stream_reassembles_to_the_result(pair, tokenizer, routing):
    engine = engine_for(pair, tokenizer)
    req = request(PROMPT, 20, seed=4, **routing)
    text, ids, sources = "", [], []
    for event in engine.stream(req):
        if event.retracted:
            assert text.endswith(event.retracted_text)
            text = text[: len(text) - len(event.retracted_text)]
            del ids[len(ids) - event.retracted :]
            del sources[len(sources) - event.retracted :]
        text += event.text
        ids.append(event.token_id)
        sources.append(event.source)
        assert event.index == len(ids) - 1
    result = engine.generate(req)
    assert tuple(ids) == result.token_ids and tuple(sources) == result.sources
    assert text == result.text


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0), "top_p"),
        (lambda: RoutingParams(thresholds=(2.0, 1.0)), "ascending"),
        (lambda: RoutingParams(rate=1.5), "rate"),
        (lambda: GenerationRequest(()), "at least one token"),
    ],
)
def test_bad_parameters_are_refused_clearly(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_engine_refuses_bad_requests(pair, tokenizer):
    engine = engine_for(pair, tokenizer, context_window=64)
    with pytest.raises(ValueError, match="context window"):
        engine.submit(request(PROMPT, 100))
    with pytest.raises(ValueError, match="unknown router"):
        engine.submit(request(PROMPT, 4, "nonsense"))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 48\)"):
        engine.submit(request((3, 999), 4))
    with pytest.raises(ValueError, match="thresholds"):
        engine.submit(request(PROMPT, 4, "entropy", thresholds=(1.0, 2.0)))
    assert engine.models[0].request_ids() == []


def test_the_detokenizer_decodes_exactly_as_the_tokenizer(tokenizer):
    """The step loop decodes through the fast tokenizer's backend (no per-id Python checks):
    the text must be the tokenizer's own, special tokens skipped, on byte-level BPE too."""
    import random
    from pathlib import Path

    from transformers import AutoTokenizer

    from backoff_core.engine.state import Detokenizer

    tokenizers = [tokenizer]
    bpe = Path(__file__).resolve().parents[4] / "shared" / "gpu" / "tok"  # SmolLM2's, beside the repo
    if bpe.exists():
        tokenizers.append(AutoTokenizer.from_pretrained(str(bpe)))
    rng = random.Random(0)
    for tok in tokenizers:
        detok = Detokenizer(tok)
        assert detok.decode is not None
        for n in (1, 3, 40, 300):
            for _ in range(20):
                ids = [rng.randrange(len(tok)) for _ in range(n)] + [tok.eos_token_id]
                assert detok.decode(ids) == tok.decode(ids, skip_special_tokens=True)
