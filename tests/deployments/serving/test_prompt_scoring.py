"""Prompt logprobs over the SmallModel -> LargeModel catch-up path (no Ray): a catch-up call
may name rows to score, and the replica answers their target log-probabilities and top-n
(ScoredRows) instead of full logits; an ordinary catch-up in the same forward is answered
as before. Through RemoteLarge the engine's prompt logprobs equal the in-process engine's;
the engine thread answers a request that is done at admission (max_tokens 0)."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from backoff_core.errors import LargeUnavailable
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.scoring import Scoring
from backoff_core.types import GenerationRequest, GenerationResult, RoutingParams, SamplingParams
from deployments.serving.batcher import CatchUpBatcher
from deployments.serving.catchup_wire import CatchUpCall
from deployments.serving.config import RoutingConfig
from deployments.serving.engine_loop import EngineLoop
from deployments.serving.outcomes import Admitted, Failed
from tests.support.helpers import engine_for
from tests.support.remote_fakes import FakeEndpoint, remote_engine

PROMPT = tuple(range(3, 23))


class _Calls(ModelRunner):
    """A ModelRunner that keeps the keyword arguments of every extend."""

    def __init__(self, model, name):
        super().__init__(model, name)
        self.kwargs: list[dict] = []

    def extend(self, items, hidden_layer=None, last_only=False, **kwargs):
        self.kwargs.append(kwargs)
        return super().extend(items, hidden_layer, last_only, **kwargs)


@torch.no_grad()
def _log_softmax(model, prompt) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([list(prompt)])).logits[0].float(), -1)


def test_a_scored_call_answers_its_rows_and_an_ordinary_one_beside_it_is_unchanged(pair, loop_thread):
    large = pair[1]
    runner = _Calls(large, "large")
    batcher = CatchUpBatcher(runner, batch_wait_s=1.0, batch_gap_s=0.2)
    rows = (0, 4, 7, 11)
    scoring = Scoring(rows, tuple(PROMPT[j + 1] for j in rows), top_n=3)
    scored_call = CatchUpCall("s#1", 0, PROMPT[:-1], "g", 2, last_only=True, scoring=scoring)
    plain_call = CatchUpCall("p#1", 0, (5, 6, 7), "g", 2, last_only=True)

    async def step():
        return await asyncio.gather(batcher.extend(scored_call), batcher.extend(plain_call))

    scored, plain = loop_thread.run(step())
    assert batcher.stats.forward_passes == 1 and runner.kwargs == [{"scoring": [scoring, None]}]
    expected = _log_softmax(large, PROMPT)
    assert scored.logits.shape == (1, runner.vocab_size)  # the last row: no full logits per scored row
    s = scored.scored
    assert s.target.shape == (4,) and s.top_ids.shape == s.top.shape == (4, 3)
    torch.testing.assert_close(
        torch.from_numpy(s.target), expected[list(rows), [PROMPT[j + 1] for j in rows]], atol=1e-4, rtol=0
    )
    want = torch.topk(expected[list(rows)], 3)
    assert s.top_ids.tolist() == want.indices.tolist()
    torch.testing.assert_close(torch.from_numpy(s.top), want.values, atol=1e-4, rtol=0)
    # the ordinary catch-up: its last row, as alone, and no scored rows
    assert plain.scored is None and plain.logits.shape == (1, runner.vocab_size)
    alone = ModelRunner(large, "alone")
    alone.open("a")
    torch.testing.assert_close(
        torch.from_numpy(plain.logits), alone.extend([("a", [5, 6, 7])], last_only=True)[0].logits, atol=1e-4, rtol=0
    )
    # on the wire: a few numbers a scored row, not V floats
    assert len(pickle.dumps(s)) < 1000


def test_ordinary_catch_ups_pass_no_scoring(pair, loop_thread):
    runner = _Calls(pair[1], "large")
    batcher = CatchUpBatcher(runner, batching=False)
    loop_thread.run(batcher.extend(CatchUpCall("a#1", 0, (3, 4, 5))))
    assert runner.kwargs == [{}]  # the ordinary path: the runner's call exactly as before


def test_a_bad_scoring_fails_its_call_alone(pair, loop_thread):
    batcher = CatchUpBatcher(ModelRunner(pair[1], "large"), batching=False)
    with pytest.raises(ValueError, match="outside an extend"):
        loop_thread.run(batcher.extend(CatchUpCall("a#1", 0, (3, 4), scoring=Scoring((2,), (5,)))))
    assert batcher.runner.request_ids() == [] and batcher.stats.forward_passes == 0
    reply = loop_thread.run(batcher.extend(CatchUpCall("b#1", 0, (3, 4), scoring=Scoring((1,), (5,)))))
    assert reply.scored.target.shape == (1,)


def _req(prompt, router, max_tokens=0, seed=None, top_n=2, **routing) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, prompt_logprobs=top_n, seed=seed, ignore_eos=True, logprobs=1)
    return GenerationRequest(tuple(prompt), sampling, RoutingParams(router=router, **routing))


REQUESTS = [
    _req(PROMPT, "always-large"),
    _req(PROMPT[:9], "random", rate=0.5, seed=3),
    _req(PROMPT[1:], "entropy", thresholds=(0.4,), max_tokens=8),  # echo, then generation
    _req(PROMPT[:6], "always-small", max_tokens=4),
]


def test_remote_prompt_logprobs_equal_in_process(pair, tokenizer, loop_thread):
    endpoint = FakeEndpoint(pair[1], loop_thread)
    engine, remote = remote_engine(pair, tokenizer, endpoint)
    served = engine.generate_many(REQUESTS)
    local = engine_for(pair, tokenizer).generate_many(REQUESTS)
    for out, ref in zip(served, local):
        assert (out.prompt_sources, out.token_ids, out.sources) == (ref.prompt_sources, ref.token_ids, ref.sources)
        got = [e and (e.chosen.logprob, *[t.logprob for t in e.top]) for e in out.prompt_logprobs]
        want = [e and (e.chosen.logprob, *[t.logprob for t in e.top]) for e in ref.prompt_logprobs]
        assert got == [w and pytest.approx(w, abs=1e-4) for w in want]
        assert [e.chosen.logprob for e in out.logprobs] == pytest.approx([e.chosen.logprob for e in ref.logprobs])
    assert served[0].prompt_sources[1:] == (1,) * (len(PROMPT) - 1)
    assert {0, 1} <= set(served[1].prompt_sources) and {0, 1} <= set(served[2].prompt_sources)
    # the prompt heads went out together (one group) as scored calls naming exactly the rows
    # routed to M_L, answered with the last row's logits only
    scored = [c for c in endpoint.calls if c.scoring is not None]
    assert len({c.group for c in scored}) == 1 and all(c.last_only and c.past == 0 for c in scored)
    by_head = {r.prompt_ids[:-1]: (r.prompt_ids, res) for r, res in zip(REQUESTS, served)}
    assert len(scored) == sum(1 in res.prompt_sources for res in served)
    for c in scored:
        prompt, res = by_head[c.ids]
        routed = [j for j, s in enumerate(res.prompt_sources[1:]) if s == 1]
        assert list(c.scoring.rows) == routed and list(c.scoring.targets) == [prompt[j + 1] for j in routed]
    assert remote.lost_sessions == 0
    assert not any(b.runner.request_ids() for b in endpoint.replicas)  # freed on finish


def test_the_engine_thread_answers_a_request_done_at_admission(pair, tokenizer):
    """max_tokens 0 (a scored prompt) finishes at admission: its result comes, nothing hangs."""
    engine = engine_for(pair, tokenizer)
    loop = EngineLoop(engine, lambda request, policy: request, RoutingConfig())
    loop.start()

    async def consume(request):
        q = loop.submit(request)
        items = [await asyncio.wait_for(q.get(), 20)]
        while not isinstance(items[-1], GenerationResult):
            items.append(await asyncio.wait_for(q.get(), 20))
        return items

    async def main():  # the scored one alone first: no other request's step collects it
        return await consume(_req(PROMPT, "always-large")), await consume(_req(PROMPT[:5], "always-large", 3))

    try:
        scored, generating = asyncio.run(main())
    finally:
        loop.stop()
    assert isinstance(scored[0], Admitted) and scored[-1].token_ids == () and len(scored) == 2
    assert len(generating[-1].token_ids) == 3 and generating[-1].prompt_sources == (None, 1, 1, 1, 1)
    expected = engine_for(pair, tokenizer).generate(_req(PROMPT, "always-large"))
    assert [e and e.chosen.logprob for e in scored[-1].prompt_logprobs] == pytest.approx(
        [e and e.chosen.logprob for e in expected.prompt_logprobs]
    )
    assert engine.live_ids() == []


class _Silent:
    """A LargeModel that never answers in time."""

    transport_errors = ()

    class _Pending:
        def result(self, timeout_s=None):
            raise TimeoutError

    def extend(self, call):
        return self._Pending()

    def close(self, session_key):
        pass


def test_a_large_model_that_cannot_score_the_prompt_fails_the_request_as_unavailable(pair, tokenizer):
    engine, _ = remote_engine(pair, tokenizer, _Silent())
    with pytest.raises(LargeUnavailable):
        engine.submit(_req(PROMPT, "always-large"))
    assert engine.live_ids() == [] and engine.models[0].request_ids() == []
    engine.generate(_req(PROMPT, "always-small"))  # M_L is not needed: it is not called
    loop = EngineLoop(engine, lambda request, policy: request, RoutingConfig())
    loop.start()

    async def main():
        q = loop.submit(_req(PROMPT, "always-large"))
        return await asyncio.wait_for(q.get(), 20)

    try:
        failed = asyncio.run(main())
    finally:
        loop.stop()
    assert isinstance(failed, Failed) and failed.unavailable


def test_an_oracle_scores_a_long_prompt_with_bounded_replies(pair, tokenizer, loop_thread):
    """Oracle echo scoring of a 200-token prompt over RemoteLarge: M_S's logits of at most
    max_logit_rows rows go to M_L a call (Scoring.against: 2 MiB of float32 at most, 10 rows
    at V = 49152), chunked at 128 rows a step or not; M_L answers each row's KL, target and
    top-n and no logits row (a reply pickles to a few numbers a row); the sources and scores
    equal the in-process engine's."""
    prompt = tuple((7 * i + 3) % 40 + 2 for i in range(200))
    sampling = SamplingParams(max_tokens=0, prompt_logprobs=5, seed=1)
    request = GenerationRequest(prompt, sampling, RoutingParams(router="oracle", thresholds=(5.0,)))
    local = engine_for(pair, tokenizer).generate(request)
    assert {0, 1} <= set(local.prompt_sources[1:])
    for chunk in (0, 128):
        endpoint = FakeEndpoint(pair[1], loop_thread)
        engine, remote = remote_engine(pair, tokenizer, endpoint)
        engine.prefill_chunk_tokens = chunk
        assert remote.max_logit_rows * 4 * remote.vocab_size <= 2 << 20
        remote.max_logit_rows = 7  # the tiny vocabulary would allow thousands
        out = engine.generate(request)
        assert out.prompt_sources == local.prompt_sources
        got = [e and (e.chosen.logprob, *[t.logprob for t in e.top]) for e in out.prompt_logprobs]
        want = [e and (e.chosen.logprob, *[t.logprob for t in e.top]) for e in local.prompt_logprobs]
        assert got == [w and pytest.approx(w, abs=1e-4) for w in want]
        assert all(c.last_only for c in endpoint.calls)  # no call asks for full logits
        scored = [(c, reply) for c, reply in endpoint.replies if c.scoring is not None]
        assert sum(len(c.scoring.rows) for c, _ in scored) == len(prompt) - 1  # every row once
        for call, reply in scored:
            rows = len(call.scoring.rows)
            assert rows <= 7 and tuple(call.scoring.against.shape) == (rows, remote.vocab_size)
            assert call.scored_only and reply.logits.shape[0] == 0 and len(reply.scored.kl) == rows
            # 4 (KL) + 4 (target) + 5 x (4 + 4) (top-5) = 48 bytes a row, and the pickle's frame
            assert len(pickle.dumps(reply)) <= 1500 + 48 * rows
