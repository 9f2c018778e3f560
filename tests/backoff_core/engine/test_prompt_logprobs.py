"""Prompt logprobs (engine/prompt.py): each prompt token's log-probability under the request's
routed teacher-forced distribution. always-large equals plain transformers' log_softmax of M_L
over the prompt, always-small M_S's; a router's mixture is computed here by hand from the
models' own logits; only the rows routed to a larger model are scored there (never full
logits); batched equals alone; generation goes on after the prompt."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backoff_core.engine.engine import BackoffEngine
from backoff_core.engine.logprobs import TokenTexts
from backoff_core.engine.prompt import prompt_offsets
from backoff_core.routing.routers import build_router
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.factory import make_runner
from backoff_core.runners.scoring import Scoring
from backoff_core.sampling import Stream, entropy, kl_divergence, uniforms
from backoff_core.types import FinishReason, GenerationRequest, KVSpec, RoutingParams, SamplingParams
from tests.support.helpers import engine_for, hf_greedy

PROMPT = (3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)


def _req(prompt=PROMPT, top_n=0, max_tokens=0, router="always-large", seed=None, **routing) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, prompt_logprobs=top_n, seed=seed, ignore_eos=True)
    return GenerationRequest(tuple(prompt), sampling, RoutingParams(router=router, **routing))


@torch.no_grad()
def _log_softmax(model, prompt) -> torch.Tensor:
    """[T, V] plain transformers: log_softmax of the model's logits over the whole prompt."""
    return torch.log_softmax(model(torch.tensor([list(prompt)])).logits[0].float(), -1)


def _check(result, expected: torch.Tensor, sources, prompt=PROMPT, top_n=0) -> None:
    """expected: [T, V], row j the distribution that scores prompt token j + 1."""
    assert result.prompt_logprobs[0] is None and result.prompt_sources[0] is None
    assert len(result.prompt_logprobs) == len(prompt) == len(result.prompt_sources)
    assert list(result.prompt_sources[1:]) == list(sources)
    for j, entry in enumerate(result.prompt_logprobs[1:]):
        assert entry.chosen.token_id == prompt[j + 1]
        assert entry.chosen.logprob == pytest.approx(float(expected[j, prompt[j + 1]]), abs=1e-4)
        want = torch.topk(expected[j], top_n)
        assert [t.token_id for t in entry.top] == want.indices.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(want.values.tolist(), abs=1e-4)


def _static_engine(models, tokenizer) -> BackoffEngine:
    kv = KVSpec(budget_tokens=4 * 64, max_len=64, cuda_graphs=False)
    runners = [make_runner(models[0], "small", kv, small=True), make_runner(models[1], "large", kv)]
    return BackoffEngine(runners, tokenizer)


ENGINES = {"dynamic": engine_for, "static": _static_engine}


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("router, level", [("always-large", 1), ("always-small", 0)])
def test_always_one_model_is_exactly_its_log_softmax(pair, tokenizer, kind, router, level):
    result = ENGINES[kind](pair, tokenizer).generate(_req(top_n=3, router=router))
    expected = _log_softmax(pair[level], PROMPT)
    _check(result, expected, [level] * (len(PROMPT) - 1), top_n=3)
    assert result.finish_reason == FinishReason.LENGTH and result.token_ids == () and result.text == ""


@pytest.mark.parametrize("kind", ENGINES)
def test_a_threshold_router_scores_each_position_with_the_level_it_picks(pair, tokenizer, kind):
    """entropy of M_S at row j >= T -> M_L's distribution there, else M_S's: computed by hand."""
    small, large = _log_softmax(pair[0], PROMPT), _log_softmax(pair[1], PROMPT)
    with torch.no_grad():
        ent = entropy(pair[0](torch.tensor([list(PROMPT)])).logits[0])[:-1]  # [T-1]
    threshold = float(ent.median())
    levels = (ent >= threshold).long().tolist()
    assert set(levels) == {0, 1}  # the mixture really mixes
    expected = torch.where(torch.tensor(levels)[:, None].bool(), large[:-1], small[:-1])
    engine = ENGINES[kind](pair, tokenizer)
    result = engine.generate(_req(top_n=2, router="entropy", thresholds=(threshold,)))
    _check(result, expected, levels, top_n=2)


def test_the_oracle_routes_by_the_true_kl(pair, tokenizer):
    with torch.no_grad():
        ids = torch.tensor([list(PROMPT)])
        kl = kl_divergence(pair[1](ids).logits[0], pair[0](ids).logits[0])[:-1]
    threshold = float(kl.median())
    levels = (kl >= threshold).long().tolist()
    small, large = _log_softmax(pair[0], PROMPT), _log_softmax(pair[1], PROMPT)
    expected = torch.where(torch.tensor(levels)[:, None].bool(), large[:-1], small[:-1])
    result = engine_for(pair, tokenizer).generate(_req(router="oracle", thresholds=(threshold,)))
    _check(result, expected, levels)


def test_the_classifier_reads_the_hidden_state_of_its_layer(pair, tokenizer):
    engine = engine_for(pair, tokenizer, hidden_size=32)
    head = engine.routers(_req(router="classifier")).head
    with torch.no_grad():
        out = pair[0](torch.tensor([list(PROMPT)]), output_hidden_states=True)
        scores = head.score(out.hidden_states[head.layer][0], out.logits[0]).float()[:-1]
    # halfway between the two middle scores: no score sits at the threshold, where the
    # engine's forward and this one may differ in the last bit (transformers' versions do)
    low, high = scores.sort().values[len(scores) // 2 - 1 : len(scores) // 2 + 1].tolist()
    assert high - low > 1e-4
    threshold = (low + high) / 2
    levels = (scores >= threshold).long().tolist()
    assert set(levels) == {0, 1}
    small, large = _log_softmax(pair[0], PROMPT), _log_softmax(pair[1], PROMPT)
    expected = torch.where(torch.tensor(levels)[:, None].bool(), large[:-1], small[:-1])
    _check(engine.generate(_req(router="classifier", thresholds=(threshold,))), expected, levels)


class _Scorings(ModelRunner):
    """A ModelRunner that keeps the scoring of every extend and the rows of logits it returned."""

    def __init__(self, model, name):
        super().__init__(model, name)
        self.scorings: list[list[Scoring | None] | None] = []
        self.logit_rows = 0

    def extend(self, items, hidden_layer=None, last_only=False, scoring=None):
        self.scorings.append(scoring)
        out = super().extend(items, hidden_layer, last_only, scoring)
        self.logit_rows += sum(e.logits.shape[0] for e in out)
        return out


def test_the_large_model_scores_only_the_rows_routed_to_it(pair, tokenizer):
    prompt = tuple(range(2, 42))
    engine = BackoffEngine([ModelRunner(pair[0], "small"), _Scorings(pair[1], "large")], tokenizer)
    result = engine.generate(_req(prompt, router="random", rate=0.5, seed=7))
    routed = [j for j, s in enumerate(result.prompt_sources[1:]) if s == 1]
    assert 0 < len(routed) < len(prompt) - 1
    (scoring,) = engine.models[1].scorings  # one forward of M_L: the prompt head, scored rows only
    assert list(scoring[0].rows) == routed and list(scoring[0].targets) == [prompt[j + 1] for j in routed]
    assert engine.models[1].logit_rows == 1  # full logits of the last row only
    expected = torch.where(
        torch.tensor(result.prompt_sources[1:])[:, None].bool(),
        _log_softmax(pair[1], prompt)[:-1],
        _log_softmax(pair[0], prompt)[:-1],
    )
    _check(result, expected, result.prompt_sources[1:], prompt)


def test_always_small_never_calls_the_large_model(pair, tokenizer):
    engine = BackoffEngine([ModelRunner(pair[0], "small"), _Scorings(pair[1], "large")], tokenizer)
    engine.generate(_req(router="always-small"))
    assert engine.models[1].scorings == [] and engine.models[1].forward_passes == 0


def test_random_is_seeded_and_keeps_its_share(pair, tokenizer):
    prompt = tuple((7 * i) % 46 + 2 for i in range(400))
    engine = engine_for(pair, tokenizer)
    runs = [engine.generate(_req(prompt, router="random", rate=0.3, seed=s)) for s in (11, 11, 12)]
    assert runs[0].prompt_sources == runs[1].prompt_sources != runs[2].prompt_sources
    assert [e and e.chosen.logprob for e in runs[0].prompt_logprobs] == [
        e and e.chosen.logprob for e in runs[1].prompt_logprobs
    ]
    # the coin of position j + 1 (sampling.uniforms, the router's stream) against the rate
    coins = uniforms([11] * (len(prompt) - 1), range(1, len(prompt)), Stream.ROUTER)[:, 0]
    assert list(runs[0].prompt_sources[1:]) == (coins >= 0.3).long().tolist()
    share = sum(s == 0 for s in runs[0].prompt_sources[1:]) / (len(prompt) - 1)
    assert share == pytest.approx(0.3, abs=0.07)


def test_target_backoff_scores_the_prompt_at_the_controllers_first_threshold(pair, tokenizer):
    result = engine_for(pair, tokenizer).generate(_req(router="random", target_backoff=0.5, seed=3))
    coins = uniforms([3] * (len(PROMPT) - 1), range(1, len(PROMPT)), Stream.ROUTER)[:, 0]
    assert list(result.prompt_sources[1:]) == (coins.double() >= result.thresholds[0]).long().tolist()


def test_a_chain_of_three_scores_with_every_level(chain3, tokenizer):
    prompt = tuple(range(2, 40))
    result = engine_for(chain3, tokenizer).generate(_req(prompt, 1, router="random", seed=5, thresholds=(0.4, 0.7)))
    sources = result.prompt_sources[1:]
    assert set(sources) == {0, 1, 2}
    per_level = torch.stack([_log_softmax(m, prompt)[:-1] for m in chain3])  # [3, T-1, V]
    _check(result, per_level[torch.tensor(sources), torch.arange(len(sources))], sources, prompt, 1)


def test_batched_equals_alone_in_one_prefill(pair, tokenizer):
    requests = [
        _req(PROMPT, 2, router="always-large"),
        _req(PROMPT[:5], 1, router="random", rate=0.5, seed=4),
        _req(tuple(range(2, 30)), 0, router="always-small"),
        _req((9,), 2),  # one token: nothing to score
        GenerationRequest(PROMPT[:7], SamplingParams(max_tokens=3, ignore_eos=True)),  # no prompt logprobs
    ]
    alone = [engine_for(pair, tokenizer).generate(r) for r in requests]
    engine = engine_for(pair, tokenizer)
    batched = engine.generate_many(requests)
    small, large = engine.models
    assert small.forward_passes == 2 + 3  # the prefill: one forward for the scored, one for the plain; 3 steps
    for a, b in zip(alone, batched):
        assert a.prompt_sources == b.prompt_sources and a.token_ids == b.token_ids
        if a.prompt_logprobs is None:
            assert b.prompt_logprobs is None
            continue
        assert [e and e.chosen.logprob for e in a.prompt_logprobs] == pytest.approx(
            [e and e.chosen.logprob for e in b.prompt_logprobs], abs=1e-5
        )
        assert [e and [t.token_id for t in e.top] for e in a.prompt_logprobs] == [
            e and [t.token_id for t in e.top] for e in b.prompt_logprobs
        ]
    assert batched[3].prompt_logprobs == (None,) and batched[3].prompt_sources == (None,)


def test_echo_then_generation_goes_on_as_usual(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    req = _req(top_n=1, max_tokens=6, router="always-large")
    req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, logprobs=1))
    result = engine.generate(req)
    assert result.token_ids == hf_greedy(pair[1], PROMPT, 6) and set(result.sources) == {1}
    _check(result, _log_softmax(pair[1], PROMPT), [1] * (len(PROMPT) - 1), top_n=1)
    full = _log_softmax(pair[1], PROMPT + result.token_ids)
    for i, e in enumerate(result.logprobs):
        assert e.chosen.logprob == pytest.approx(float(full[len(PROMPT) - 1 + i, result.token_ids[i]]), abs=1e-4)
    # the same request without prompt logprobs generates the same
    plain = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, prompt_logprobs=None))
    assert engine.generate(plain).token_ids == result.token_ids


def test_echo_with_a_mixed_router_generates_what_it_would_without(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    req = _req(max_tokens=10, router="entropy", thresholds=(0.4,), seed=2)
    plain = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, prompt_logprobs=None))
    a, b = engine.generate(req), engine.generate(plain)
    assert (a.token_ids, a.sources) == (b.token_ids, b.sources) and b.prompt_logprobs is None


def test_max_tokens_zero_finishes_at_once_and_frees_its_sessions(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    request_id = engine.submit(_req())
    assert not engine.has_work() and engine.finished_ids() == [request_id]
    result = engine.finish(request_id)
    assert result.token_ids == () and result.finish_reason == FinishReason.LENGTH
    assert result.prompt_text == tokenizer.decode(list(PROMPT))
    assert engine.models[0].request_ids() == [] and engine.models[1].request_ids() == []
    assert list(engine.stream(_req())) == []


def test_text_offsets_index_the_prompt_text(pair, tokenizer):
    result = engine_for(pair, tokenizer).generate(_req())
    offsets = [e.text_offset for e in result.prompt_logprobs[1:]]
    assert offsets == sorted(offsets)
    for e, nxt in zip(result.prompt_logprobs[1:], offsets[1:] + [len(result.prompt_text)]):
        assert result.prompt_text[e.text_offset : nxt].strip() == e.chosen.token


def test_byte_level_offsets_start_a_split_character_where_it_starts():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=alphabet, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = hf.encode("a é b", add_special_tokens=False)  # a, space, \xc3, \xa9, space, b
    text, offsets = prompt_offsets(ids, TokenTexts(hf), hf.decode)
    assert text == "a é b" and offsets == [0, 1, 2, 2, 3, 4]


def test_bad_values_are_refused(pair, tokenizer):
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1, prompt_logprobs=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=20).max_tokens == 0
    engine = engine_for(pair, tokenizer)
    with pytest.raises(ValueError, match="draft router makes no decision on a prompt"):
        engine.submit(_req(router="draft"))
    with pytest.raises(ValueError, match="scripted router"):
        engine.submit(_req(router="always-large"), build_router("scripted", script=[1]))
    assert engine.live_ids() == [] and engine.models[0].request_ids() == []


def test_a_bad_request_in_a_batch_admits_none(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.submit_many([_req(), _req((3, 4, 99))])
    assert engine.live_ids() == [] and engine.models[0].request_ids() == []


def test_scoring_rows_are_checked(pair):
    runner = ModelRunner(pair[1], "large")
    runner.open("a")
    with pytest.raises(ValueError, match="outside an extend of 3"):
        runner.extend([("a", [3, 4, 5])], scoring=[Scoring((0, 3), (4, 5))])
    with pytest.raises(ValueError, match="targets must be in"):
        runner.extend([("a", [3, 4, 5])], scoring=[Scoring((0,), (48,))])
    with pytest.raises(ValueError, match="ascending"):
        Scoring((2, 1), (4, 5))
    assert runner.length("a") == 0  # nothing ran


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_runner_runs_its_lm_head_on_the_scored_rows_only(pair, kind):
    """Two ragged sessions, one scored and one not, in one forward: the scored rows equal
    transformers' log_softmax, the other session's last logits are unchanged, and the LM head
    saw the scored rows and each session's last row only."""
    large = pair[1]
    if kind == "dynamic":
        runner = ModelRunner(large, "large")
    else:
        runner = make_runner(large, "large", KVSpec(budget_tokens=4 * 64, max_len=64, cuda_graphs=False))
    heads = []
    hook = large.lm_head.register_forward_hook(lambda m, args, out: heads.append(tuple(args[0].shape)))
    try:
        prompt, other = tuple(range(3, 23)), (5, 6, 7, 8)
        for key in ("a", "b"):
            runner.open(key)
        scoring = Scoring((1, 6, 12), tuple(prompt[j + 1] for j in (1, 6, 12)), top_n=4)
        scored, plain = runner.extend(
            [("a", list(prompt[:-1])), ("b", list(other))], last_only=True, scoring=[scoring, None]
        )
    finally:
        hook.remove()
    expected = _log_softmax(large, prompt)
    assert scored.scored.target.tolist() == pytest.approx(
        [float(expected[j, prompt[j + 1]]) for j in (1, 6, 12)], abs=1e-4
    )
    want = torch.topk(expected[[1, 6, 12]], 4)
    assert scored.scored.top_ids.tolist() == want.indices.tolist()
    torch.testing.assert_close(scored.scored.top, want.values, atol=1e-4, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(plain.logits[0], large(torch.tensor([list(other)])).logits[0, -1], atol=1e-4, rtol=0)
        torch.testing.assert_close(
            scored.logits[0], large(torch.tensor([list(prompt[:-1])])).logits[0, -1], atol=1e-4, rtol=0
        )
    assert scored.logits.shape[0] == plain.logits.shape[0] == 1 and plain.scored is None
    (shape,) = heads
    assert shape[1] <= 5  # 3 scored rows and the last of each session, not 19 positions a row


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_runner_scores_rows_against_m_s_logits(pair, kind):
    """Scoring.against (an oracle's prompt scoring): the runner answers each scored row's
    KL(M_L || M_S) with its target and top-n, equal to the KL of plain transformers' logits of
    both models there; logits of the wrong shape are refused before anything runs."""
    small, large = pair
    if kind == "dynamic":
        runner = ModelRunner(large, "large")
    else:
        runner = make_runner(large, "large", KVSpec(budget_tokens=4 * 64, max_len=64, cuda_graphs=False))
    prompt, rows = tuple(range(3, 23)), (0, 5, 17)
    with torch.no_grad():
        ids = torch.tensor([list(prompt)])
        s_logits, l_logits = small(ids).logits[0], large(ids).logits[0]
    runner.open("a")
    bad = Scoring(rows, tuple(prompt[j + 1] for j in rows), 2, s_logits[[0, 5]])
    with pytest.raises(ValueError, match="needs \\[3, 48\\] logits"):
        runner.extend([("a", list(prompt[:-1]))], last_only=True, scoring=[bad])
    assert runner.length("a") == 0
    scoring = Scoring(rows, tuple(prompt[j + 1] for j in rows), 2, s_logits[list(rows)])
    (ext,) = runner.extend([("a", list(prompt[:-1]))], last_only=True, scoring=[scoring])
    want = kl_divergence(l_logits[list(rows)], s_logits[list(rows)])
    torch.testing.assert_close(ext.scored.kl, want, atol=1e-5, rtol=1e-4)
    assert float(want.min()) > 0  # the pair's distributions differ at every row: a KL to find
    expected = _log_softmax(large, prompt)
    assert ext.scored.target.tolist() == pytest.approx([float(expected[j, prompt[j + 1]]) for j in rows], abs=1e-4)


def _recorded(extend, calls: list):
    """extend, recording (new ids of its first item, last_only) of each call."""

    def recorded(items, **kw):
        calls.append((len(items[0][1]), kw.get("last_only")))
        return extend(items, **kw)

    return recorded


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("router", ["always-large", "entropy", "random"])
def test_scoring_from_a_position_gives_the_tail_of_the_full_scoring(pair, tokenizer, kind, router):
    """prompt_logprobs_from = f: the entries from position f are those of a full scoring (the
    same levels, values within float noise of a prefill split in two), the earlier ones None;
    M_S's LM head runs on the scored rows alone."""
    prompt = tuple((5 * i) % 40 + 2 for i in range(30))
    routing = {"thresholds": (2.0,)} if router == "entropy" else {"rate": 0.5} if router == "random" else {}
    full = ENGINES[kind](pair, tokenizer).generate(_req(prompt, 2, router=router, seed=7, **routing))
    for first in (1, 2, 17, 29, 40):
        sampling = SamplingParams(max_tokens=0, prompt_logprobs=2, prompt_logprobs_from=first, seed=7)
        engine = ENGINES[kind](pair, tokenizer)
        small, calls = engine.models[0], []
        extend = small.extend
        small.extend = _recorded(extend, calls)
        tail = engine.generate(GenerationRequest(prompt, sampling, RoutingParams(router=router, **routing)))
        f = min(first, len(prompt) - 1)
        # M_S: a plain prefill of the rows before the first scored one, then logits over the rest
        assert calls == ([(f - 1, True)] if f > 1 else []) + [(len(prompt) - f, False)]
        assert tail.prompt_logprobs[:f] == (None,) * f and tail.prompt_sources[:f] == (None,) * f
        assert tail.prompt_sources[f:] == full.prompt_sources[f:]
        for a, b in zip(tail.prompt_logprobs[f:], full.prompt_logprobs[f:]):
            assert a.chosen.token_id == b.chosen.token_id
            assert a.chosen.logprob == pytest.approx(b.chosen.logprob, abs=1e-4)
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    with pytest.raises(ValueError, match="prompt_logprobs_from"):
        SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_from=0)
