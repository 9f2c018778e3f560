"""M_S's next step launched ahead (engine/ahead.py): every request gets the tokens, sources,
logprobs and text it gets without; the bookkeeping of the launched rows is exact on a
hand-counted run (always-small: every row launched is taken but the last launch's; M_S's
cache is never left ahead of what the engine fed it); the launch is queued after the copy
of the step's tokens and before the host waits for it; a failed launch costs nothing but
itself; and a runner that cannot read ids on the device is refused up front."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from backoff_core.engine import ahead, host
from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.factory import make_runner
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams, Verification
from tests.support.failing import Failing

KV = KVSpec(budget_tokens=16 * 64, max_len=64)
PROMPTS = [(3, 4, 5, 6), (7, 8), (9, 10, 11, 12, 13), (5,), (6, 7, 8), (14, 15, 16, 17), (18, 19)]


def _engine(pair, tokenizer, kv: KVSpec | None = KV, **kwargs) -> BackoffEngine:
    small, large = pair
    return BackoffEngine(
        [make_runner(small, "small", kv, small=True), make_runner(large, "large", kv)], tokenizer, **kwargs
    )


def _requests(n: int, sampling: dict, routing: dict, tokens: int = 16) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            PROMPTS[i % len(PROMPTS)],
            SamplingParams(max_tokens=tokens, seed=11 + i, **sampling),
            RoutingParams(**routing),
        )
        for i in range(n)
    ]


def _seen(results) -> list[tuple]:
    """What a request sees but its logprobs' values (`_close`)."""
    lps = [[(c.chosen.token_id, [t.token_id for t in c.top]) for c in r.logprobs or ()] for r in results]
    return [(r.token_ids, r.sources, r.text, r.finish_reason, lp) for r, lp in zip(results, lps)]


def _close(got, want) -> None:
    """Logprobs to 1e-5: a row's logits in another batch differ in the last bits (float32
    sums in another order), as batched and alone do without launching ahead."""

    def flat(results) -> list[float]:
        return [v for r in results for c in r.logprobs or () for v in (c.chosen.logprob, *(t.logprob for t in c.top))]

    assert flat(got) == pytest.approx(flat(want), abs=1e-5)


SCENARIOS = {
    # name: (engine kwargs, sampling, routing)
    "always-small": ({}, dict(temperature=0.8), dict(router="always-small")),
    "random b=0.9, batched catch-ups": ({}, dict(temperature=0.8), dict(router="random", rate=0.9)),
    "random b=0.5, at once": (
        dict(catch_up_wait_ms=0),
        dict(temperature=1.0, top_p=0.9),
        dict(router="random", rate=0.5),
    ),
    "entropy, logprobs, stop": ({}, dict(logprobs=2, stop=("w7 w7",)), dict(router="entropy")),
    "classifier (hidden layer), greedy": (dict(hidden_size=32), {}, dict(router="classifier")),
    "penalties": (
        {},
        dict(temperature=1.0, presence_penalty=0.4, repetition_penalty=1.3),
        dict(router="random", rate=0.7),
    ),
    "three levels": ({}, dict(temperature=1.0), dict(router="random", thresholds=(0.4, 0.7))),
    # prompts fed 3 tokens a step, and catch-ups of more stalled until M_L is fed (chunked.py)
    "chunked prefill, stalls": (
        dict(prefill_chunk_tokens=3, catch_up_wait_ms=0),
        dict(temperature=0.8),
        dict(router="random", rate=0.5),
    ),
}


@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_launching_ahead_gives_every_request_the_same_tokens(pair, chain3, tokenizer, name, n):
    kwargs, sampling, routing = SCENARIOS[name]
    models = chain3 if name == "three levels" else pair
    reqs = _requests(n, sampling, routing)

    def run(ahead: bool):
        runners = [make_runner(m, f"m{i}", KV, small=i == 0) for i, m in enumerate(models)]
        engine = BackoffEngine(runners, tokenizer, launch_ahead=ahead, **kwargs)
        return engine.generate_many(reqs), engine

    want, _ = run(False)
    got, engine = run(True)
    assert _seen(got) == _seen(want)
    _close(got, want)
    assert engine.ahead.rows_used > 0  # steps did take launched rows
    assert [m.request_ids() for m in engine.models] == [[]] * len(models)


def test_plain_and_verified_requests_together(pair, tokenizer):
    """A request that verifies drafts is never launched (it steps as without); the plain ones
    beside it are, and everyone's tokens are those of the engine without launching ahead."""
    plain = _requests(4, dict(temperature=0.9), dict(router="random", rate=0.8))
    verified = _requests(3, dict(temperature=1.0), dict(router="draft", verification=Verification.EXACT))
    reqs = [r for pair_ in zip(plain, verified) for r in pair_] + plain[3:]
    want = _engine(pair, tokenizer).generate_many(reqs)
    engine = _engine(pair, tokenizer, launch_ahead=True)
    launched = []
    launcher = engine.ahead.launcher
    engine.ahead.launcher = lambda stepped, deferred: (
        launched.append({r.request.routing.router for r in stepped if engine.ahead.launchable(r)})
        or launcher(stepped, deferred)
    )
    assert _seen(engine.generate_many(reqs)) == _seen(want)
    assert set().union(*launched) == {"random"} and sum(r.rollbacks for r in want) > 0


def test_always_small_takes_every_launched_row_but_the_last_launchs(pair, tokenizer):
    """n requests of T tokens, always-small: step 1 runs M_S as without (nothing launched
    yet) and launches step 2, ..., step T launches a step nobody takes. So n*T rows launched,
    n*(T-1) taken, T steps, and M_S runs T+1 forwards (the prompts' prefill, T-1 launches
    taken, the first step and the last launch: 1 + T)."""
    n, tokens = 5, 12
    engine = _engine(pair, tokenizer, launch_ahead=True)
    small = engine.models[0]
    rids = engine.submit_many(_requests(n, {}, dict(router="always-small"), tokens=tokens))
    before, steps = small.forward_passes, 0
    while engine.has_work():
        engine.step()
        steps += 1
        for r in engine._live.values():  # M_S's cache: what the engine fed it, plus the launched row
            launched = engine.ahead.pending is not None and r.request_id in engine.ahead.pending.at
            assert small.length(r.request_id) == r.fed[0] + launched
    assert [len(engine.finish(rid).token_ids) for rid in rids] == [tokens] * n
    assert steps == tokens and small.forward_passes - before == tokens + 1
    assert (engine.ahead.rows_launched, engine.ahead.rows_used) == (n * tokens, n * (tokens - 1))


def test_a_row_not_taken_is_cropped_back_and_a_caught_up_one_rides_the_next_launch(pair, tokenizer):
    """Random routing with batched catch-ups: after every step M_S's cache of each live
    request holds exactly the engine's fed[0] (+1 for a row launched ahead): a routed row's
    launched position is cropped; a request caught up in the last step steps one step later
    (deferred), so the run takes more steps, never fewer tokens."""
    reqs = _requests(7, dict(temperature=0.8), dict(router="random", rate=0.6), tokens=16)
    want = _engine(pair, tokenizer)
    want_steps = 0
    rids = want.submit_many(reqs)
    while want.has_work():
        want.step()
        want_steps += 1
    want_results = [want.finish(rid) for rid in rids]
    engine = _engine(pair, tokenizer, launch_ahead=True)
    small = engine.models[0]
    rids, steps, cropped = engine.submit_many(reqs), 0, 0
    crop = small.crop

    def counted(request_id, length):
        nonlocal cropped
        cropped += small.length(request_id) > length
        crop(request_id, length)

    small.crop = counted
    while engine.has_work():
        engine.step()
        steps += 1
        for r in engine._live.values():
            if not r.done:
                launched = engine.ahead.pending is not None and r.request_id in engine.ahead.pending.at
                assert small.length(r.request_id) == r.fed[0] + launched
    assert _seen([engine.finish(rid) for rid in rids]) == _seen(want_results)
    assert cropped > 0 and steps > want_steps
    assert engine.ahead.rows_used < engine.ahead.rows_launched


def test_the_launch_is_queued_after_the_tokens_copy_and_before_the_wait(pair, tokenizer, monkeypatch):
    """Within a step: the read of M_S's tokens starts (its copy queued), then M_S's next
    forward is launched with the drawn ids on the device, then the host waits for the read."""
    engine = _engine(pair, tokenizer, launch_ahead=True)
    order = []
    start_read, values, extend = host.Read.__init__, host.Read.values, engine.models[0].extend

    def started(self, parts, queued):
        order.append("copy" if queued else "copy, read at once")  # queued: on CUDA, pinned + an event
        start_read(self, parts, queued)

    def waited(self):
        order.append("wait")
        return values(self)

    def extended(items, **kwargs):
        if kwargs.get("on_device") is not None:
            assert isinstance(kwargs["on_device"], torch.Tensor) and len(kwargs["on_device"]) == len(items)
            order.append("launch")
        return extend(items, **kwargs)

    monkeypatch.setattr(host.Read, "__init__", started)
    monkeypatch.setattr(host.Read, "values", waited)
    monkeypatch.setattr(engine.models[0], "extend", extended)
    engine.submit_many(_requests(3, {}, dict(router="always-small"), tokens=4))
    engine.step()
    assert order == ["copy", "launch", "wait"]
    order.clear()
    engine.step()  # on the launched rows: no M_S forward before the draw
    assert order == ["copy", "launch", "wait"]
    engine.launch_ahead = False  # without: to_host's read, as it always was
    order.clear()
    engine.step()
    assert order == ["copy, read at once", "wait"]


def test_a_failed_launch_costs_only_itself(pair, tokenizer, monkeypatch, caplog):
    reqs = _requests(4, dict(temperature=0.8), dict(router="random", rate=0.7), tokens=10)
    want = _engine(pair, tokenizer).generate_many(reqs)
    engine = _engine(pair, tokenizer, launch_ahead=True)
    extend = engine.models[0].extend

    def refusing(items, **kwargs):
        if kwargs.get("on_device") is not None:
            raise RuntimeError("no launch today")
        return extend(items, **kwargs)

    monkeypatch.setattr(engine.models[0], "extend", refusing)
    with caplog.at_level(logging.WARNING, logger="backoff_core.engine.ahead"):
        assert _seen(engine.generate_many(reqs)) == _seen(want)
    assert "no launch today" in caplog.text and engine.ahead.rows_used == 0


def test_a_runner_that_cannot_read_ids_on_the_device_is_refused(pair, tokenizer):
    with pytest.raises(ValueError, match="launch_ahead needs M_S on static KV"):
        _engine(pair, tokenizer, kv=None, launch_ahead=True)
    with pytest.raises(ValueError, match="do not go together"):
        _engine(pair, tokenizer, launch_ahead=True, overlap_catch_ups=True)
    engine = _engine(pair, tokenizer, launch_ahead=True)
    with pytest.raises(ValueError, match="do not go together"):
        engine.overlap_catch_ups = True


def test_the_setting_resolves_auto_to_static_kv_on_cuda_and_true_to_static_kv_anywhere(pair, caplog):
    """ahead.resolve: auto launches where M_S is on static KV on CUDA and catch-ups are not in
    flight (a stand-in runner on CUDA here; the real one on the CPU stays off, silently); true
    wherever M_S is on static KV, off with a warning over per-session caches; false never."""
    small = pair[0]
    static, dynamic = make_runner(small, "small", KV, small=True), make_runner(small, "small", None, small=True)
    on_cuda = SimpleNamespace(extends_on_device=True, device=torch.device("cuda"))
    caches_on_cuda = SimpleNamespace(device=torch.device("cuda"))
    with caplog.at_level(logging.WARNING, logger="backoff_core.engine.ahead"):
        assert ahead.resolve("auto", on_cuda) is True
        assert ahead.resolve("auto", on_cuda, overlap_catch_ups=True) is False
        assert ahead.resolve("auto", caches_on_cuda) is False
        assert ahead.resolve("auto", static) is False and static.device.type == "cpu"
        assert ahead.resolve(False, on_cuda) is False
        assert ahead.resolve(True, static) is True
        assert not caplog.records
        assert ahead.resolve(True, dynamic) is False
    assert [r.getMessage() for r in caplog.records] == [
        "launch_ahead: M_S keeps per-session caches here (no static KV), so its steps are not launched ahead"
    ]
    with pytest.raises(ValueError, match="launch_ahead is auto, true or false, not 'on'"):
        ahead.resolve("on", static)


def test_a_request_degraded_by_a_lost_large_model_gets_the_same_tokens(pair, tokenizer):
    """M_L gives no reply for "b" (backends.LargeUnavailable): "b" degrades to M_S at its first
    catch-up and goes on launched ahead (its M_S cache never moved), the others as before."""
    reqs = [
        GenerationRequest(
            p, SamplingParams(max_tokens=14, seed=i, temperature=0.8), RoutingParams("random", rate=0.6), rid
        )
        for i, (p, rid) in enumerate([((3, 4, 5), "a"), ((6, 7), "b"), ((8, 9, 10), "c")])
    ]

    def run(ahead: bool):
        runners = [make_runner(pair[0], "small", KV, small=True), Failing(pair[1], after=0, dead={"b"})]
        return BackoffEngine(runners, tokenizer, launch_ahead=ahead).generate_many(reqs)

    want, got = run(False), run(True)
    assert _seen(got) == _seen(want)
    assert [r.degraded for r in got] == [False, True, False]
