"""Penalties' counts on the device (engine/penalties.py): exact bookkeeping against a recount
on hand-written token scripts, the logits they give against vLLM's formula, and every draw
of the engine, rollbacks and verification included, against a recount of its sequence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import backoff_core.engine.catchup as catchup
import backoff_core.engine.propose as propose
from backoff_core.engine.penalties import penalties_at
from backoff_core.engine.state import Live
from backoff_core.routing.routers import build_router
from backoff_core.sampling import Penalties, distributions
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams, Verification
from tests.support.helpers import engine_for, penalized_greedy

V = 12
PROMPT = (3, 4, 5, 6)


def live(request_id: str, prompt=(1, 2, 1), repetition=1.3, presence=0.0, frequency=0.5) -> Live:
    sampling = SamplingParams(
        max_tokens=32, repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency
    )
    request = GenerationRequest(tuple(prompt), sampling, RoutingParams(router="always-small"))
    r = Live(request, request_id, build_router("always-small"), (0.5,), seed=0, num_levels=2)
    r.tokens = list(prompt)
    return r


def recount(r: Live, position: int) -> tuple[list[float], list[bool]]:
    """The counts and seen mask at `position`, from the sequence itself."""
    generated, before = r.tokens[r.prompt_len : position], set(r.tokens[:position])
    return [float(generated.count(t)) for t in range(V)], [t in before for t in range(V)]


def check(rows: list[tuple[Live, int]]) -> Penalties | None:
    logits = torch.zeros(len(rows), V)
    pen = penalties_at(rows, logits)
    penalized = [i for i, (r, _) in enumerate(rows) if r.request.sampling.penalized]
    if not penalized:
        assert pen is None
        return pen
    assert pen.at == tuple(penalized) and pen.rows.tolist() == penalized
    for k, i in enumerate(penalized):
        counts, seen = recount(*rows[i])
        assert pen.counts[k].tolist() == counts, (rows[i][1], rows[i][0].tokens)
        if pen.seen is not None:
            assert pen.seen[k].tolist() == seen
    return pen


def test_counts_follow_appends_earlier_positions_rollbacks_and_new_requests():
    a, b = live("a"), live("b", prompt=(7,), repetition=1.0, presence=0.4, frequency=0.0)
    plain = live("plain", repetition=1.0, frequency=0.0)
    assert check([(plain, 3)]) is None and plain.penalty is None  # unpenalized: nothing kept
    check([(a, 3), (plain, 3)])  # a's first draw: nothing generated yet, the prompt seen
    a.tokens += [5, 5, 2]
    check([(a, 6)])  # three committed since: +1 each
    b.tokens += [7, 7]
    check([(b, 3), (a, 6), (plain, 3)])  # b opens while a holds
    a.tokens += [9, 5]
    pen = check([(a, 4), (a, 6), (a, 7), (a, 8), (b, 3)])  # verification: earlier positions of one request
    assert a.penalty.upto == 8 and torch.equal(a.penalty.counts, pen.counts[3])  # the furthest row kept
    assert pen.seen is not None  # a repeats; b's rows read its prompt mask too
    assert a.truncate(5) == 3 and a.tokens == [1, 2, 1, 5, 5]  # a rollback drops 2, 9, 5 (all counted)
    check([(a, 5)])
    a.tokens += [0, 0]
    check([(a, 7), (a, 6)])
    a.truncate(6)
    a.truncate(4)  # two rollbacks before the next draw
    check([(a, 4), (b, 5 - 2)])
    b.tokens += [3]
    check([(b, 4)])


def test_a_row_narrower_or_wider_than_the_counts_is_cut_or_padded():
    r = live("a")
    r.tokens += [2, 11]
    penalties_at([(r, 5)], torch.zeros(1, V))
    narrow = penalties_at([(r, 5)], torch.zeros(1, 8))
    assert narrow.counts[0].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]  # 11 past the width counts nothing
    wide = penalties_at([(r, 5)], torch.zeros(1, V + 4))
    assert wide.counts[0].tolist()[V - 1 :] == [1, 0, 0, 0, 0]
    # opened narrow, then a wider model's id past the width: counted nothing (not an index
    # past the row, which a GPU turns into a device-side assert), rolled back the same
    n = live("n")
    penalties_at([(n, 3)], torch.zeros(1, 8))
    n.tokens += [2, 11, 3]
    assert penalties_at([(n, 6)], torch.zeros(1, 8)).counts[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    n.truncate(4)
    assert penalties_at([(n, 4)], torch.zeros(1, 8)).counts[0].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_penalized_logits_are_vllms_formula(temperature):
    """repetition (HF's) over prompt and generated ids, then -presence and -frequency x count over
    the generated ones, beside an unpenalized row and a logit_bias that still adds."""
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    rows = [live("a", repetition=1.5, presence=0.3, frequency=0.7), live("plain", repetition=1.0, frequency=0.0)]
    rows.append(live("b", prompt=(4,), repetition=1.0, presence=1.0, frequency=0.0))
    rows[0].tokens += [2, 8, 8]
    rows[2].tokens += [4, 9]
    at = [(rows[0], 6), (rows[1], 3), (rows[2], 3)]
    params = [dataclasses.replace(r.request.sampling, temperature=temperature) for r in rows]
    params[0] = dataclasses.replace(params[0], logit_bias=((8, 2.0),))
    got = distributions(logits, params, None, penalties_at(at, logits))
    want = logits.clone()
    for i, (r, position) in enumerate(at):
        s, seen, generated = params[i], sorted(set(r.tokens[:position])), r.tokens[r.prompt_len : position]
        x = want[i, seen]
        want[i, seen] = torch.where(x > 0, x / s.repetition_penalty, x * s.repetition_penalty)
        for t in set(generated):
            want[i, t] -= s.presence_penalty + s.frequency_penalty * generated.count(t)
    assert torch.equal(got, distributions(want, params))  # which adds the logit_bias after them


@pytest.mark.parametrize(
    "routing",
    [
        dict(router="random", rate=0.5),
        dict(router="random", rate=0.6, verification=Verification.EXACT, draft_tokens=2),
        dict(router="random", rate=0.6, verification=Verification.KL, tolerance=0.05),
    ],
)
def test_every_draw_of_the_engine_reads_a_recount_of_its_sequence(pair, tokenizer, monkeypatch, routing):
    """Draws, verification's tests at pending positions and rollbacks: each penalized batch the
    engine builds equals a recount of its rows' sequences at their positions."""
    seen = {"batches": 0, "rows": 0, "earlier": 0}

    def checked(rows, logits):
        pen = penalties_at(rows, logits)
        for k, i in enumerate(pen.at if pen is not None else ()):
            r, position = rows[i]
            generated = r.tokens[r.prompt_len : position]
            assert pen.counts[k].tolist() == [float(generated.count(t)) for t in range(logits.shape[-1])]
            assert pen.seen[k].nonzero()[:, 0].tolist() == sorted(set(r.tokens[:position]))
            seen["rows"] += 1
            seen["earlier"] += position < len(r.tokens)
        seen["batches"] += pen is not None
        return pen

    monkeypatch.setattr(propose, "penalties_at", checked)
    monkeypatch.setattr(catchup, "penalties_at", checked)
    engine = engine_for(pair, tokenizer)
    sampling = SamplingParams(
        max_tokens=24, temperature=1.0, ignore_eos=True, repetition_penalty=1.4, frequency_penalty=0.6
    )
    ids = [
        engine.submit(GenerationRequest(PROMPT, dataclasses.replace(sampling, seed=s), RoutingParams(**routing)))
        for s in range(4)
    ]
    while engine.has_work():
        engine.step()
    results = [engine.finish(i) for i in ids]
    assert all(len(r.token_ids) == 24 for r in results)
    assert seen["rows"] >= 4 * 24
    if routing.get("verification"):
        assert seen["earlier"] > 0  # verification tested pending positions
        assert sum(r.rollbacks for r in results) > 0  # and rolled some back


def test_greedy_penalized_backoff_at_rate_one_is_m_ls_penalized_decoding(pair, tokenizer):
    """Every step large, its catch-ups batched across requests: the penalties read each
    request's own counts."""
    want = penalized_greedy(pair[1], PROMPT, 12, presence=0.5, repetition=1.3)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=0.5, repetition_penalty=1.3)
    engine = engine_for(pair, tokenizer)
    routing = RoutingParams(router="random", rate=0.0)  # no step stays small
    ids = [engine.submit(GenerationRequest(PROMPT, sampling, routing)) for _ in range(3)]
    while engine.has_work():
        engine.step()
    assert [engine.finish(i).token_ids for i in ids] == [want] * 3
