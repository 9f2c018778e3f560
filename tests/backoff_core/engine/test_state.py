"""Per-request bookkeeping (backoff_core/engine/state.py) on hand-written token scripts:
what Live records, what truncate/prune forget, what result() carries, and the stable text
the Detokenizer streams. No model runs here except for the controller test."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from backoff_core.engine.state import Detokenizer, Live
from backoff_core.routing.control import LOWEST
from backoff_core.routing.routers import AlwaysSmall
from backoff_core.types import FinishReason, Logprob, SamplingParams, TokenLogprobs
from tests.support.helpers import engine_for, request

PROMPT = (3, 4, 5)


def live(num_levels: int = 2, generated=(), sources=(), fed=None, thresholds=(0.5,), **sampling) -> Live:
    req = request(PROMPT, max_tokens=8)
    if sampling:
        req = type(req)(req.prompt_ids, SamplingParams(max_tokens=8, **sampling), req.routing)
    return Live(
        request=req,
        request_id="r1",
        router=AlwaysSmall(),
        thresholds=torch.tensor(thresholds, dtype=torch.float64),
        seed=0,
        num_levels=num_levels,
        tokens=[*PROMPT, *generated],
        sources=list(sources),
        fed=list(fed or [0] * num_levels),
    )


def logprob(token: int) -> TokenLogprobs:
    return TokenLogprobs(Logprob(token, f"w{token - 2}", b"", -1.0), (), 0)


def test_a_fresh_request_holds_its_prompt_and_is_not_done():
    r = live()
    assert (r.prompt_len, r.generated, r.done) == (3, [], False)
    r.failure = RuntimeError("x")
    assert r.done
    assert live(generated=[9]).generated == [9]


def test_drafts_count_smaller_levels_tokens_since_the_largest_model_read():
    # generated 10..14 from levels 0,1,0,0,0; M_L has read the prompt and the first two
    r = live(generated=[10, 11, 12, 13, 14], sources=[0, 1, 0, 0, 0], fed=[8, 5])
    assert r.drafts() == 3
    r.fed[-1] = 0  # M_L read nothing yet: every small token since the prompt counts
    assert r.drafts() == 4
    three = live(3, generated=[10, 11, 12], sources=[1, 2, 0], fed=[6, 4, 3])
    assert three.drafts() == 2  # a medium token is a draft too; level 2's is not


def test_truncate_drops_tokens_sources_logprobs_and_logits_from_the_position_on():
    r = live(generated=[10, 11, 12, 13], sources=[0, 1, 0, 0])
    r.logprobs = [logprob(t) for t in (10, 11, 12, 13)]
    r.source_logits = {j: torch.zeros(4) for j in range(3, 7)}
    r.small_logits = {j: torch.zeros(4) for j in range(3, 7)}
    assert r.truncate(5) == 2
    assert (r.tokens, r.sources) == ([3, 4, 5, 10, 11], [0, 1])
    assert [lp.chosen.token_id for lp in r.logprobs] == [10, 11]
    assert sorted(r.source_logits) == sorted(r.small_logits) == [3, 4]


def test_prune_forgets_logits_of_positions_every_larger_level_has_read():
    r = live(3, generated=[10, 11, 12], fed=[6, 5, 4])
    r.source_logits = {j: torch.zeros(4) for j in range(3, 6)}
    r.small_logits = {j: torch.zeros(4) for j in range(3, 6)}
    r.prune()  # horizon = min(fed[1:]) = 4: position 3 cannot be verified any more
    assert sorted(r.source_logits) == sorted(r.small_logits) == [4, 5]


def test_result_carries_the_records_and_float64_thresholds():
    r = live(generated=[10, 11], sources=[0, 1], thresholds=(3.4e38,))
    r.stats.rollbacks, r.degraded = 2, "large timed out"
    res = r.result("w8 w9")
    assert (res.request_id, res.text, res.token_ids, res.sources) == ("r1", "w8 w9", (10, 11), (0, 1))
    assert (res.prompt_tokens, res.num_levels, res.rollbacks) == (3, 2, 2)
    assert res.finish_reason == FinishReason.LENGTH  # not finished yet: the length ran out
    assert res.thresholds == (3.4e38,) and math.isfinite(res.thresholds[0])
    assert res.degraded and res.degraded_reason == "large timed out"
    assert res.logprobs is None  # not asked for
    assert res.timings.first_token == res.timings.total  # no token streamed: the whole time


def test_result_finish_reason_and_logprobs_when_asked():
    r = live(generated=[10], sources=[0], logprobs=0)
    r.logprobs, r.finished = [logprob(10)], FinishReason.STOP
    res = r.result("w8")
    assert res.finish_reason == FinishReason.STOP and res.logprobs == (logprob(10),)


def test_the_rate_controller_sees_every_step_and_its_threshold_reaches_the_result(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    request_id = engine.submit(request([3, 4, 5], 10, "entropy", target_backoff=0.5))
    r = engine._live[request_id]  # the Live the step loop updates
    assert r.controller is not None and float(r.thresholds[0]) == r.controller.threshold
    while engine.has_work():
        engine.step()
    assert r.controller.steps == len(r.generated) == 10
    assert r.controller.small_steps == r.sources.count(0)
    assert engine.finish(request_id).thresholds == (r.controller.threshold,)


@pytest.mark.parametrize(
    "ignore_eos, stop, horizon", [(True, (), 10), (False, (), None), (True, ("\n",), None), (False, ("x",), None)]
)
def test_the_controller_knows_the_horizon_only_when_the_request_cannot_end_earlier(
    pair, tokenizer, ignore_eos, stop, horizon
):
    engine = engine_for(pair, tokenizer)
    base = request([3, 4, 5], 10, "entropy", target_backoff=0.5)
    sampling = dataclasses.replace(base.sampling, ignore_eos=ignore_eos, stop=stop)
    request_id = engine.submit(dataclasses.replace(base, sampling=sampling))
    assert engine._live[request_id].controller.horizon == horizon


def test_target_backoff_zero_starts_at_the_lowest_threshold(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    request_id = engine.submit(request([3, 4, 5], 4, "entropy", target_backoff=0.0))
    assert list(engine._live[request_id].thresholds) == [LOWEST]


# -- Detokenizer ------------------------------------------------------------------------------
class Script:
    """A tokenizer whose decode is a table: prefixes of generated ids -> text."""

    def __init__(self, table: dict[tuple[int, ...], str]) -> None:
        self.table = table

    def decode(self, ids, skip_special_tokens=True):
        return self.table[tuple(ids)]


def test_events_stream_only_the_new_stable_text(tokenizer):
    detok, r = Detokenizer(tokenizer), live()
    texts = []
    for token in (5, 6, 7):
        r.tokens.append(token)
        event = detok.event(r, 0, 0)
        texts.append(event.text)
        assert event.index == len(r.generated) - 1 and event.token_id == token
    assert texts == ["w3", " w4", " w5"] and r.text == "w3 w4 w5"


def test_a_rollback_event_retracts_the_text_it_replaces(tokenizer):
    detok, r = Detokenizer(tokenizer), live(generated=[5, 6], sources=[0, 0])
    detok.event(r, 0, 0)
    r.truncate(4)  # drop w4, commit w9 from the large model in its place
    r.tokens.append(11)
    event = detok.event(r, 1, 1)
    # "w3 w4" -> "w3 w9": only the characters after the common prefix "w3 w" change
    assert (event.text, event.retracted, event.retracted_text) == ("9", 1, "4")
    assert event.source == 1


def test_half_a_character_waits_until_finished():
    detok = Detokenizer(Script({(10,): "ab\ufffd", (10, 11): "ab\u00e9"}))
    r = live(generated=[10])
    assert detok.event(r, 0, 0).text == "ab"
    r.tokens.append(11)
    assert detok.event(r, 0, 0).text == "\u00e9"
    ended = live(generated=[10])
    ended.finished = FinishReason.LENGTH  # nothing more can complete it: stream what there is
    assert detok.event(ended, 0, 0).text == "ab\ufffd"


def test_a_stop_string_cut_keeps_the_text_before_it(tokenizer):
    r = live(generated=[5, 6, 7])
    r.cut_at = 5
    assert Detokenizer(tokenizer).full_text(r) == "w3 w4"
