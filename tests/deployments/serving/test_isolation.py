"""One request's failure ends that request alone (backoff_core/engine/isolation.py), and values
stay finite: a fault injected while handling one request -- its M_S forward, its catch-up,
its sampling, its router score, its detokenising -- beside live requests that must come
out exactly as they would alone, with every session freed. Tiny models, no Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys

import pytest
import torch

import backoff_core.engine.catchup
import backoff_core.engine.propose
import backoff_core.sampling
from backoff_core.engine.engine import BackoffEngine
from backoff_core.engine.state import Detokenizer
from backoff_core.routing.control import HIGHEST, LOWEST, RateController
from backoff_core.routing.routers import Entropy
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.sampling import Stream, request_seed, uniform
from backoff_core.types import FinishReason, GenerationResult, TokenEvent
from deployments.serving.config import RoutingConfig
from deployments.serving.engine_loop import EngineLoop
from deployments.serving.formats import chunk_body, final_chunk_body, json_safe, pb_response, response_body
from deployments.serving.outcomes import Admitted, Failed
from tests.support.helpers import engine_for, request

CULPRIT = "culprit"
BAD_SEED = 666
PROMPTS = {"a": [3, 4, 5], "b": [6, 7], CULPRIT: [8, 9, 10, 11]}


class Injected(RuntimeError):
    """The fault a test plants."""


class Flaky(ModelRunner):
    """A ModelRunner whose forwards fail once they carry the culprit's tokens (after `after`
    such calls): the forward runs and writes every session's cache, THEN raises, the way a
    failure late in a batched forward leaves caches half-written."""

    def __init__(self, model, name: str, after: int = 2) -> None:
        super().__init__(model, name)
        self.after, self.seen = after, 0

    def extend(self, items, hidden_layer=None, last_only=False):
        out = super().extend(items, hidden_layer, last_only)
        if any(request_id == CULPRIT for request_id, _ in items):
            self.seen += 1
            if self.seen > self.after:
                raise Injected(f"{self.name}: injected fault")
        return out


def _requests(router: str, seeded: bool = False, **routing) -> dict:
    """rid -> 12 greedy tokens of PROMPTS[rid] (seeds 0, 1, 2 if `seeded`)."""
    return {
        request_id: dataclasses.replace(
            request(p, 12, router, seed=i if seeded else None, **routing), request_id=request_id
        )
        for i, (request_id, p) in enumerate(PROMPTS.items())
    }


def _alone(pair, tokenizer, req, router=None) -> GenerationResult:
    return engine_for(pair, tokenizer).generate(req, router)


def _run(engine: BackoffEngine, reqs: dict, routers: dict | None = None) -> dict:
    """Every request together; rid -> its GenerationResult or the exception finish raised."""
    for request_id, req in reqs.items():
        engine.submit(req, (routers or {}).get(request_id))
    while engine.has_work():
        engine.step()
    out = {}
    for request_id in reqs:
        try:
            out[request_id] = engine.finish(request_id)
        except Exception as exc:  # noqa: BLE001 - what the test inspects
            out[request_id] = exc
    return out


def _check(out: dict, pair, tokenizer, reqs: dict, routers: dict | None = None, says: str = "injected") -> None:
    assert isinstance(out[CULPRIT], Exception) and says in str(out[CULPRIT]), out[CULPRIT]
    for request_id in ("a", "b"):
        alone = _alone(pair, tokenizer, reqs[request_id], (routers or {}).get(request_id))
        assert isinstance(out[request_id], GenerationResult), out[request_id]
        assert (out[request_id].token_ids, out[request_id].sources) == (alone.token_ids, alone.sources), request_id
        assert len(out[request_id].token_ids) == 12 and out[request_id].finish_reason == FinishReason.LENGTH


def _no_sessions(engine: BackoffEngine) -> None:
    assert engine.live_ids() == []
    assert all(not m.request_ids() for m in engine.models)


@pytest.mark.parametrize("router", ["entropy", "always-small"])
def test_a_failed_small_forward_ends_only_its_request(pair, tokenizer, router):
    reqs = _requests(router, thresholds=(0.4,)) if router == "entropy" else _requests(router)
    engine = BackoffEngine([Flaky(pair[0], "small"), ModelRunner(pair[1], "large")], tokenizer)
    out = _run(engine, reqs)
    _check(out, pair, tokenizer, reqs)  # the survivors' caches were rebuilt, not extended twice
    _no_sessions(engine)


@pytest.mark.parametrize("router", ["always-large", "entropy"])
def test_a_failed_catch_up_ends_only_its_request(pair, tokenizer, router):
    reqs = _requests(router, thresholds=(0.4,)) if router == "entropy" else _requests(router)
    engine = BackoffEngine([ModelRunner(pair[0], "small"), Flaky(pair[1], "large", after=1)], tokenizer)
    out = _run(engine, reqs)
    _check(out, pair, tokenizer, reqs)
    assert any(s == 1 for s in out["a"].sources + out["b"].sources)
    _no_sessions(engine)


@pytest.mark.parametrize("router", ["always-small", "always-large"])
def test_a_sampling_error_ends_only_its_request(pair, tokenizer, monkeypatch, router):
    """The engine draws the tokens of all small steps in one batched call, a catch-up those
    of its level (one params per row): the culprit's row makes the batch raise."""
    reqs = _requests(router)
    culprit = reqs[CULPRIT]
    reqs[CULPRIT] = dataclasses.replace(culprit, sampling=dataclasses.replace(culprit.sampling, seed=BAD_SEED))
    real, calls = backoff_core.sampling.draw, []

    def draw(logits, params, *args, **kwargs):
        if any(p.seed == BAD_SEED for p in params):
            calls.append(1)
            if len(calls) > 3:
                raise Injected("injected: probabilities out of range")
        return real(logits, params, *args, **kwargs)

    # where the step loop draws: propose.py (M_S's tokens), catchup.py (a level's tokens)
    monkeypatch.setattr(backoff_core.engine.propose, "draw", draw)
    monkeypatch.setattr(backoff_core.engine.catchup, "draw", draw)
    engine = engine_for(pair, tokenizer)
    out = _run(engine, reqs)
    monkeypatch.undo()
    _check(out, pair, tokenizer, reqs)
    _no_sessions(engine)


class Poisoned(Entropy):
    """An entropy router that raises on the culprit's row at one step (found by the row's
    router coin, a pure function of its seed and position): the batched call raises."""

    def __init__(self, at: float | None) -> None:
        self.at = at

    def scores(self, ctx):
        if self.at is not None and any(abs(u - self.at) < 1e-9 for u in ctx.uniforms.tolist()):
            raise Injected("injected: router failed on one row")
        return super().scores(ctx)


def test_a_router_error_ends_only_its_request(pair, tokenizer):
    reqs = _requests("entropy", seeded=True, thresholds=(0.4,))
    culprit = reqs[CULPRIT]
    router = Poisoned(uniform(request_seed(culprit.sampling.seed), len(culprit.prompt_ids) + 2, Stream.ROUTER))
    routers = dict.fromkeys(reqs, router)  # one object: the three share each router call
    engine = engine_for(pair, tokenizer)
    out = _run(engine, reqs, routers)
    _check(out, pair, tokenizer, reqs, {request_id: Poisoned(None) for request_id in reqs})
    assert len(out["a"].timings.router_steps) == 12
    _no_sessions(engine)


class FlakyDetokenizer(Detokenizer):
    def event(self, live, source, retracted):
        if live.request_id == CULPRIT and len(live.generated) == 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return super().event(live, source, retracted)


def test_a_detokenising_error_ends_only_its_request(pair, tokenizer):
    reqs = _requests("entropy", thresholds=(0.4,))
    engine = engine_for(pair, tokenizer)
    engine.detok = FlakyDetokenizer(tokenizer)
    out = _run(engine, reqs)
    _check(out, pair, tokenizer, reqs)
    _no_sessions(engine)


def test_the_engine_loop_fails_one_stream_and_completes_the_others(pair, tokenizer):
    """Two live streams beside a request whose M_S forward fails inside the step loop: it
    gets a Failed with its error, they get all their tokens and a normal finish."""
    engine = BackoffEngine([Flaky(pair[0], "small", after=4), ModelRunner(pair[1], "large")], tokenizer)
    reqs = _requests("entropy", thresholds=(0.4,))
    loop = EngineLoop(engine, lambda r, policy: reqs[r], RoutingConfig())
    loop.start()

    async def consume(request_id):
        q = loop.submit(request_id)
        items = [await q.get()]
        while not isinstance(items[-1], (GenerationResult, Failed)):
            items.append(await q.get())
        return items

    async def main():
        return await asyncio.gather(*[consume(request_id) for request_id in reqs])

    try:
        a, b, bad = asyncio.run(main())
    finally:
        loop.stop()
    assert isinstance(bad[0], Admitted) and isinstance(bad[-1], Failed)
    assert bad[-1].code == "internal_error" and not bad[-1].unavailable
    assert "injected" not in bad[-1].message and "request culprit" in bad[-1].message  # the log has the detail
    for request_id, items in (("a", a), ("b", b)):
        result = items[-1]
        assert isinstance(result, GenerationResult) and result.finish_reason == FinishReason.LENGTH
        assert [e.token_id for e in items if isinstance(e, TokenEvent)] == list(result.token_ids)
        assert result.token_ids == _alone(pair, tokenizer, reqs[request_id]).token_ids
    assert loop.live() == 0
    _no_sessions(engine)


# -- finite values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, horizon", [(0.0, None), (1.0, None), (0.0, 3), (1.0, 3), (0.01, 2), (0.99, 2), (0.5, 1)]
)
@pytest.mark.parametrize("prior", [None, torch.linspace(0.01, 0.99, 50, dtype=torch.float64)])
def test_rate_controller_thresholds_stay_finite(target, horizon, prior):
    controller = RateController(target, 0.5, prior=prior, horizon=horizon)
    thresholds = [controller.threshold]
    g = torch.Generator().manual_seed(0)
    for score in torch.rand(40, generator=g).tolist() + [math.inf, math.nan, 1e308, -1e308]:
        thresholds.append(controller.update(score, went_small=score < controller.threshold))
    assert all(math.isfinite(t) for t in thresholds), thresholds
    if target == 0.0:  # every step large: every finite score reaches it
        assert thresholds[0] == LOWEST
    if target == 1.0 and horizon is None:
        assert all(t == HIGHEST for t in thresholds)


@pytest.mark.parametrize("target, source", [(0.0, 1), (1.0, 0)])
def test_target_backoff_at_the_extremes_ends_with_json_safe_thresholds(pair, tokenizer, target, source):
    req = request([3, 4, 5], max_tokens=6, router="entropy", target_backoff=target)
    result = engine_for(pair, tokenizer).generate(req)
    assert result.sources == (source,) * 6
    assert all(math.isfinite(t) for t in result.thresholds)
    json.dumps(response_body("cmpl-1", "m", 0, result, chat=False), allow_nan=False)


def test_huge_thresholds_stay_finite_in_float64(pair, tokenizer):
    result = engine_for(pair, tokenizer).generate(request([3, 4], 4, "entropy", thresholds=(3.4e38,)))
    assert result.thresholds == (3.4e38,) and result.sources == (0,) * 4  # float32 made it inf
    result = engine_for(pair, tokenizer).generate(request([3, 4], 4, "entropy", thresholds=(math.inf,)))
    assert result.thresholds == (sys.float_info.max,)


def test_every_response_body_is_json_safe(pair, tokenizer):
    result = engine_for(pair, tokenizer).generate(request([3, 4], 3))
    result = dataclasses.replace(result, thresholds=(-math.inf, math.inf, math.nan))
    event = TokenEvent(token_id=5, source=0, text="w3", index=0)
    bodies = [response_body("c", "m", 0, result, chat) for chat in (False, True)]
    bodies += [final_chunk_body("c", "m", 0, result, chat) for chat in (False, True)]
    bodies += [chunk_body("c", "m", 0, event, chat) for chat in (False, True)]
    for body in bodies:
        json.dumps(body, allow_nan=False)
    assert bodies[0]["choices"][0]["backoff"]["thresholds"] == [-sys.float_info.max, sys.float_info.max, None]
    assert list(pb_response("c", result).thresholds)[:2] == [-sys.float_info.max, sys.float_info.max]
    assert json_safe({"x": (1.5, [math.inf])}) == {"x": [1.5, [sys.float_info.max]]}


def test_a_failure_at_finish_reaches_the_stream_as_its_failed(pair, tokenizer):
    """Detokenising the whole text at the end raises: that request's Failed, not a dead loop."""

    class FailsAtTheEnd(Detokenizer):
        def full_text(self, live):
            if live.request_id == CULPRIT and live.finished:
                raise ValueError("injected: cannot decode")
            return super().full_text(live)

    engine = engine_for(pair, tokenizer)
    engine.detok = FailsAtTheEnd(tokenizer)
    reqs = _requests("always-small")
    loop = EngineLoop(engine, lambda r, policy: reqs[r], RoutingConfig())
    loop.start()

    async def main():
        queues = [loop.submit(request_id, tokens=False) for request_id in reqs]
        outs = []
        for q in queues:
            items = [await q.get()]
            while not isinstance(items[-1], (GenerationResult, Failed)):
                items.append(await q.get())
            outs.append(items[-1])
        return outs

    try:
        a, b, bad = asyncio.run(main())
    finally:
        loop.stop()
    assert isinstance(bad, Failed) and bad.code == "internal_error"  # its detail logged, not told
    assert "injected" not in bad.message and "the server failed" in bad.message
    assert isinstance(a, GenerationResult) and isinstance(b, GenerationResult) and len(b.token_ids) == 12
    _no_sessions(engine)
