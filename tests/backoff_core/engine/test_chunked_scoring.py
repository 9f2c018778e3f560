"""Chunked prompt scoring (engine/chunked.py `score`, prompt.py `score_window`): a scored
prompt longer than a chunk is scored a window of rows per step, in stage 0, beside the live
streams' steps. Its entries and levels equal scoring at admission (float noise of a prefill
split in windows); what it generates after equals; live streams commit a token every step
meanwhile; no forward reads more than a chunk of its rows; an oracle's M_L scores the rows
against M_S's logits, sent in pieces of at most `max_logit_rows` rows."""

from __future__ import annotations

import dataclasses

import pytest

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.static import StaticRunner
from backoff_core.types import FinishReason, GenerationRequest, RoutingParams, SamplingParams
from tests.support.helpers import request

CHUNK = 8
LONG = tuple((7 * i + 3) % 40 + 2 for i in range(61))  # 60 head rows: 8 windows of 8 (the last 4)
ROUTERS = {
    "always-large": {},
    "always-small": {},
    "entropy": {"thresholds": (2.0,)},
    "random": {"rate": 0.5},
    "oracle": {"thresholds": (5.0,)},
    "flipped-oracle": {"thresholds": (-5.0,)},
}


class Counted:
    """A runner recording every extend: (step, new ids per row, last_only); `step` is set by the
    test; `against`: per extend with scoring, the rows of M_S's logits each item carried."""

    def __init__(self, runner, max_logit_rows: int | None = None) -> None:
        self.runner, self.step, self.forwards, self.against = runner, -1, [], []
        if max_logit_rows is not None:
            self.max_logit_rows = max_logit_rows

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def extend(self, items, hidden_layer=None, last_only=False, **kwargs):
        self.forwards.append((self.step, [len(ids) for _, ids in items], last_only))
        if kwargs.get("scoring") is not None:
            self.against.append(
                [0 if sc is None or sc.against is None else len(sc.against) for sc in kwargs["scoring"]]
            )
        return self.runner.extend(items, hidden_layer=hidden_layer, last_only=last_only, **kwargs)


def _engine(models, tokenizer, chunk: int, storage="dynamic", max_logit_rows=None) -> BackoffEngine:
    names = ["small", *[f"medium{i}" for i in range(1, len(models) - 1)], "large"]
    if storage == "static":
        runners = [StaticRunner(m, n, kv_budget_tokens=16 * 128, max_len=128) for m, n in zip(models, names)]
    else:
        runners = [ModelRunner(m, n) for m, n in zip(models, names)]
    counted = [Counted(r, max_logit_rows if i == len(runners) - 1 else None) for i, r in enumerate(runners)]
    return BackoffEngine(counted, tokenizer, prefill_chunk_tokens=chunk)


def _scored(prompt, router, max_tokens=0, top_n=2, rid="s", first=1, **routing) -> GenerationRequest:
    sampling = SamplingParams(
        max_tokens=max_tokens, prompt_logprobs=top_n, prompt_logprobs_from=first, seed=3, ignore_eos=True
    )
    return GenerationRequest(tuple(prompt), sampling, RoutingParams(router=router, **routing), request_id=rid)


def _same(a, b) -> None:
    assert a.prompt_sources == b.prompt_sources and (a.token_ids, a.sources) == (b.token_ids, b.sources)
    assert a.prompt_text == b.prompt_text and a.finish_reason == b.finish_reason
    for x, y in zip(a.prompt_logprobs, b.prompt_logprobs, strict=True):
        if x is None or y is None:
            assert x is y
            continue
        assert x.chosen.token_id == y.chosen.token_id and x.text_offset == y.text_offset
        assert x.chosen.logprob == pytest.approx(y.chosen.logprob, abs=1e-4)
        assert [t.token_id for t in x.top] == [t.token_id for t in y.top]


CASES = [(router, "dynamic") for router in ROUTERS] + [(r, "static") for r in ("always-large", "entropy", "oracle")]


@pytest.mark.parametrize("router, storage", CASES)
def test_chunked_scoring_equals_scoring_at_admission(pair, tokenizer, storage, router):
    """Every window decides and scores as the whole prompt did, and generation after it is
    the same (max_tokens 0 and the streams beside it: the tests below)."""
    req = _scored(LONG, router, 6, **ROUTERS[router])
    off = _engine(pair, tokenizer, 0, storage).generate(req)
    engine = _engine(pair, tokenizer, CHUNK, storage)
    on = engine.generate(req)
    _same(on, off)
    assert on.prompt_sources[1:] and len(on.prompt_logprobs) == len(LONG)
    # at most a chunk of the prompt's rows per forward, at every level
    for model in engine.models:
        assert all(max(rows) <= CHUNK for step, rows, _ in model.forwards if step == -1), model.forwards


def test_a_chain_of_three_and_a_late_first_row_score_in_chunks_as_at_admission(chain3, pair, tokenizer):
    req = _scored(LONG, "random", 0, 1, thresholds=(0.4, 0.7))
    _same(_engine(chain3, tokenizer, CHUNK).generate(req), _engine(chain3, tokenizer, 0).generate(req))
    for first in (2, 17, 40):  # the rows before prompt_logprobs_from: a plain prefill, then windows
        req = _scored(LONG, "entropy", 0, 2, first=first, thresholds=(2.0,))
        _same(_engine(pair, tokenizer, CHUNK).generate(req), _engine(pair, tokenizer, 0).generate(req))


def test_live_streams_commit_every_step_while_a_long_prompt_is_scored(pair, tokenizer):
    """Two streams run; a 60-row prompt scored at chunk 8 takes 8 steps of stage 0, in which
    both streams commit a token each step; M_S reads at most one window of its rows a step."""
    engine = _engine(pair, tokenizer, CHUNK)
    streams = [
        dataclasses.replace(request((3 + i, 4, 5), 40, "random", seed=i, rate=0.5), request_id=f"t{i}") for i in (0, 1)
    ]
    engine.submit_many(streams)
    engine.step()
    scored_id = engine.submit(_scored(LONG, "oracle", thresholds=(5.0,)))
    small = engine.models[0]
    committed, s = [], 0
    while scored_id not in engine.finished_ids():
        small.step = s
        events = engine.step()
        committed.append(sorted(events))
        s += 1
    assert s == 8 and committed == [["t0", "t1"]] * 8  # the streams stepped in every step of its scoring
    windows = [rows for step, rows, last_only in small.forwards if step >= 0 and not last_only and len(rows) == 1]
    assert [w[0] for w in windows] == [8] * 7 + [4]  # one window of its rows a step
    result = engine.finish(scored_id)
    assert result.finish_reason == FinishReason.LENGTH and result.token_ids == ()
    assert len(result.prompt_logprobs) == len(LONG) and result.prompt_logprobs[0] is None
    assert engine.models[0].runner.request_ids() == sorted(engine.live_ids())  # its sessions freed


def test_an_oracle_sends_m_s_rows_in_pieces_of_max_logit_rows(pair, tokenizer):
    """An oracle's M_L never answers full logits over the prompt: it scores each row against
    M_S's logits there (Scoring.against), which travel at most max_logit_rows rows a call
    (RemoteLarge.max_logit_rows, where they cross a wire), at admission or in chunks, every
    row once; the scores are the same."""
    req = _scored(LONG, "oracle", 0, 3, thresholds=(5.0,))
    whole = _engine(pair, tokenizer, 0).generate(req)
    for chunk in (0, CHUNK):
        engine = _engine(pair, tokenizer, chunk, max_logit_rows=3)
        _same(engine.generate(req), whole)
        large = engine.models[1]
        assert all(last_only for _, _, last_only in large.forwards)  # no extend of full logits
        assert large.against and max(max(rows) for rows in large.against) <= 3
        assert sum(sum(rows) for rows in large.against) == len(LONG) - 1  # every row once


def test_a_failed_window_ends_the_scored_requests_alone(pair, tokenizer):
    engine = _engine(pair, tokenizer, CHUNK)
    stream = dataclasses.replace(request((3, 4, 5), 12, "always-small"), request_id="t")
    engine.submit(stream)
    scored_id = engine.submit(_scored(LONG, "always-large"))
    large = engine.models[1]

    def broken(items, **kwargs):
        raise RuntimeError("M_L broke")

    large.extend = broken
    while engine.has_work():
        engine.step()
    with pytest.raises(RuntimeError, match="M_L broke"):
        engine.finish(scored_id)
    assert len(engine.finish("t").token_ids) == 12
    assert engine.models[0].runner.request_ids() == []
