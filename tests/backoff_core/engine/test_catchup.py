"""Exact pending / catch-up bookkeeping on hand-written token scripts, and the catch-up
invariant: M_L's logits after catch-up equal a full recompute of the sequence."""

from __future__ import annotations

import pytest
import torch

from backoff_core.engine.engine import BackoffEngine
from backoff_core.routing.routers import Scripted
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.types import Verification
from tests.support.helpers import Recording, engine_for, hf_greedy, request

PROMPT = (3, 4, 5, 6)


def _levels(result, level):
    return [c.length for c in result.catch_ups if c.level == level]


def test_two_model_script_lazy_prefill(pair, tokenizer):
    small, large = pair
    runners = [Recording(small, "small"), Recording(large, "large")]
    engine = BackoffEngine(runners, tokenizer)
    script = [0, 0, 1, 0, 1, 1, 0, 0, 0, 1]
    result = engine.generate(request(PROMPT, len(script)), router=Scripted(script))
    assert result.sources == tuple(script)
    # by hand: 4 prompt + 2 small tokens; then g2, g3; then g4; then g5..g8
    assert _levels(result, 1) == [6, 2, 1, 4]
    assert [c.prompt_tokens for c in result.catch_ups] == [4, 0, 0, 0]
    tokens = list(PROMPT) + list(result.token_ids)
    assert [ids for _, _, ids, _ in runners[1].calls] == [tokens[0:6], tokens[6:8], tokens[8:9], tokens[9:13]]
    # M_S reads every token once: prompt head at admission, then one token per step
    assert [len(ids) for _, _, ids, _ in runners[0].calls] == [3] + [1] * len(script)
    assert result.large_calls == 4 and result.backoff_rate == 0.6


def test_two_model_script_eager_prefill(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    script = [0, 0, 1, 0, 1, 1, 0, 0, 0, 1]
    result = engine.generate(request(PROMPT, len(script), eager_prefill=True), router=Scripted(script))
    assert _levels(result, 1) == [3, 2, 1, 4]  # prompt head (3) was prefilled at admission


def test_three_model_script(chain3, tokenizer):
    runners = [Recording(m, n) for m, n in zip(chain3, ("small", "medium", "large"))]
    engine = BackoffEngine(runners, tokenizer)
    script = [0, 1, 0, 2, 0, 0, 1, 2, 1, 0]
    result = engine.generate(request(PROMPT, len(script)), router=Scripted(script))
    assert result.sources == tuple(script)
    assert _levels(result, 1) == [5, 5, 2]
    assert _levels(result, 2) == [7, 4]
    tokens = list(PROMPT) + list(result.token_ids)
    assert [ids for _, _, ids, _ in runners[1].calls] == [tokens[0:5], tokens[5:10], tokens[10:12]]
    assert [ids for _, _, ids, _ in runners[2].calls] == [tokens[0:7], tokens[7:11]]
    assert result.tokens_by_source() == (5, 3, 2)
    assert result.large_calls == 2


def test_scripted_tokens_come_from_the_scripted_model(pair, tokenizer):
    """Each large-sourced token is the large model's greedy choice given the sequence so far."""
    small, large = pair
    script = [0, 1, 1, 0, 0, 1, 0, 1]
    result = engine_for(pair, tokenizer).generate(request(PROMPT, len(script)), router=Scripted(script))
    tokens = list(PROMPT) + list(result.token_ids)
    for i, level in enumerate(script):
        model = large if level else small
        prefix = tokens[: len(PROMPT) + i]
        assert tokens[len(PROMPT) + i] == int(model(torch.tensor([prefix])).logits[0, -1].argmax())


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("verification", [Verification.NONE, Verification.KL])
def test_logits_after_catch_up_equal_full_recompute(pair, tokenizer, batched, verification):
    """Without verification a catch-up asks for the logits after its last id only (one row);
    with it, for every new position (an infinite tolerance: checked, never rolled back);
    either way they equal a full recompute."""
    small, large = pair
    runners = [ModelRunner(small, "small"), Recording(large, "large")]
    engine = BackoffEngine(runners, tokenizer)
    prompts = [PROMPT, (7,), (9, 9, 9, 9, 9, 9, 9, 1)]
    reqs = [
        request(p, 24, "random", rate=0.7, seed=i, verification=verification, tolerance=float("inf"))
        for i, p in enumerate(prompts)
    ]
    results = engine.generate_many(reqs) if batched else [engine.generate(r) for r in reqs]
    full = {}
    for r, res in zip(reqs, results):
        full[res.request_id] = list(r.prompt_ids) + list(res.token_ids)
    checked = 0
    for request_id, before, ids, logits in runners[1].calls:
        seq = full[request_id][: before + len(ids)]
        with torch.no_grad():
            reference = large(torch.tensor([seq])).logits[0, before:]
        if verification == Verification.NONE:
            reference = reference[-1:]
        assert len(logits) == len(reference)
        # tolerance: fp32, different reduction orders (padding, cache): 1e-4 absolute
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked >= 10


class Forgetful(ModelRunner):
    """Loses every session on its `lose_at`-th extend, as a crashed replica would."""

    def __init__(self, model, name, lose_at):
        super().__init__(model, name)
        self.lose_at, self.calls = lose_at, 0

    def extend(self, items, hidden_layer=None, last_only=False):
        self.calls += 1
        if self.calls == self.lose_at:
            for request_id in self.request_ids():
                self.close(request_id)
        return super().extend(items, hidden_layer, last_only)


def test_lost_large_session_is_rebuilt_by_re_prefill(pair, tokenizer):
    small, large = pair
    script = [0, 1, 0, 0, 1, 0, 1, 1]
    reference = engine_for(pair, tokenizer).generate(request(PROMPT, 8), router=Scripted(script))
    engine = BackoffEngine([ModelRunner(small, "small"), Forgetful(large, "large", lose_at=2)], tokenizer)
    result = engine.generate(request(PROMPT, 8), router=Scripted(script))
    assert result.token_ids == reference.token_ids
    # the second catch-up re-read the whole sequence (4 prompt + 4 committed) instead of 3
    assert _levels(reference, 1) == [5, 3, 2, 1]
    assert _levels(result, 1) == [5, 8, 2, 1]


def test_runner_lengths_track_fed_through_rollbacks(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    request_id = engine.submit(
        request(PROMPT, 30, "random", rate=0.7, seed=2, verification=Verification.KL, tolerance=0.5)
    )
    rollbacks = 0
    while engine.has_work():
        event = engine.step().get(request_id)
        live = engine._live[request_id]
        rollbacks += event.retracted if event else 0
        for level, model in enumerate(engine.models):
            if level in live.opened:
                assert model.length(request_id) == live.fed[level]
        assert len(live.sources) == len(live.tokens) - len(PROMPT)
    result = engine.finish(request_id)
    assert result.rollbacks == rollbacks > 0
    assert len(result.token_ids) == 30


def test_greedy_speculative_drafts_accepted_count(pair, tokenizer):
    """Accepted drafts + rollbacks add up: every small token is either kept or retracted."""
    result = engine_for(pair, tokenizer).generate(
        request(PROMPT, 20, "draft", draft_tokens=4, verification=Verification.EXACT)
    )
    _, large = pair
    assert result.token_ids == hf_greedy(large, PROMPT, 20)
    top_calls = [c for c in result.catch_ups if c.level == 1]
    assert sum(c.rolled_back for c in top_calls) == result.rollbacks


@pytest.mark.parametrize("keeps", [True, False])
def test_last_only_is_the_last_row_of_every_row(pair, keeps):
    """extend(last_only=True) gives each session the row after its last new id, for one
    session and for a ragged batch, through `logits_to_keep` or (a model without it) a slice."""
    large = pair[1]
    full, last = ModelRunner(large, "full"), ModelRunner(large, "last")
    last._keeps_logits = keeps
    steps = [
        [("a", [5, 6, 7, 8])],
        [("a", [9])],
        [("a", [3, 4]), ("b", [1, 2, 3, 4, 5, 6]), ("c", [7])],
        [("b", [2]), ("c", [8, 9, 10]), ("a", [11, 12, 13, 14])],
    ]
    for runner in (full, last):
        for request_id in "abc":
            runner.open(request_id)
    for items in steps:
        every = full.extend(items)
        ends = last.extend(items, last_only=True)
        for (_, ids), every_row, last_row in zip(items, every, ends):
            assert every_row.logits.shape[0] == len(ids) and last_row.logits.shape[0] == 1
            torch.testing.assert_close(last_row.logits, every_row.logits[-1:], atol=1e-5, rtol=1e-5)
