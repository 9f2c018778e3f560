"""Catch-ups in flight (engine.py `overlap_catch_ups`, flight.py): a batched catch-up runs
beside M_S's next steps, and its requests commit the token of the step that routed them when
it lands. Exact bookkeeping on hand-written scripts with a launcher whose flights last a
given number of steps; the same tokens as the synchronous loop with real threads; what
lands the flight early, cancelling and failing in flight."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import pytest
import torch

from backoff_core.engine.engine import BackoffEngine
from backoff_core.engine.flight import ThreadLauncher, side_stream_device
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.static import StaticRunner
from backoff_core.types import Verification
from tests.support.catch_up_scripts import pair_runners, run_steps, scripted
from tests.support.helpers import request


@dataclass
class _Lag:
    outcomes: dict
    polls: int

    def done(self) -> bool:
        self.polls -= 1
        return self.polls <= 0

    def result(self) -> dict:
        return self.outcomes


class Lagged:
    """Runs each catch-up at once in the caller's thread, and calls it done the `lag`-th time
    it is asked (the engine asks once a step): a flight that lasts `lag` steps."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.launched = 0

    def submit(self, catch):
        self.launched += 1
        return _Lag(catch(), self.lag)


def _engine(pair, tokenizer, launcher=None, wait_steps=0, storage="dynamic", fail_at=None, overlap=True):
    small, large = pair_runners(pair, storage, fail_at)
    ticks = iter(range(1, 10**6))
    engine = BackoffEngine(
        [small, large],
        tokenizer,
        catch_up_wait_ms=wait_steps * 1e3,
        clock=lambda: float(next(ticks)),
        overlap_catch_ups=overlap,
        launcher=launcher,
    )
    return engine, large


def test_a_routed_step_commits_when_its_flight_lands(pair, tokenizer):
    """Catch-ups at once (no hold), flights of 2 steps. A is routed at step 2: its catch-up
    flies and A leaves the loop; B, C, D step on; at step 4 the flight lands and A commits
    its step-2 token. B, routed at step 3 while A's flight is out, waits for it and flies at
    step 4 (landing at 6). The tokens and sources are the synchronous loop's."""
    scripts = {"A": [0, 1, 0, 0], "B": [0, 0, 1, 0], "C": [0] * 4, "D": [0] * 4}
    launcher = Lagged(2)
    engine, large = _engine(pair, tokenizer, launcher)
    scripted(engine, scripts)
    steps = run_steps(engine)
    assert steps == [set("ABCD"), set("BCD"), set("CD"), set("ACD"), {"A"}, {"A", "B"}, {"B"}]
    assert large.calls == [["A"], ["B"]] and launcher.launched == engine.flights.launched == 2
    sync, _ = _engine(pair, tokenizer, overlap=False)
    scripted(sync, scripts)
    run_steps(sync)
    for rid in scripts:
        got, want = engine.finish(rid), sync.finish(rid)
        assert (got.token_ids, got.sources) == (want.token_ids, want.sources)
        assert list(got.sources) == scripts[rid]


@pytest.mark.parametrize("storage", ["dynamic", "static"])
def test_the_same_tokens_as_the_synchronous_loop_with_a_worker_thread(pair, tokenizer, storage):
    """Sampled, random routing at 50%, 8 requests, the default hold, flights on a real worker
    thread: every request's tokens and sources are the synchronous loop's."""
    runs = {}
    for overlap in (False, True):
        engine, large = _engine(pair, tokenizer, wait_steps=3, storage=storage, overlap=overlap)
        reqs = [request((3 + i, 4, 5), 24, "random", seed=i, temperature=1.0, rate=0.5) for i in range(8)]
        results = engine.generate_many(reqs)
        runs[overlap] = [(r.token_ids, r.sources) for r in results]
        assert not engine.has_work() and engine.live_ids() == []
    assert runs[True] == runs[False]
    assert 0 < sum(s.count(1) for _, s in runs[True])  # M_L was used


def test_with_nothing_else_to_step_the_loop_waits_for_the_flight(pair, tokenizer):
    """A lone request: its flight never lands by itself (the launcher would take 99 steps),
    so the next step waits for it: every step commits a token."""
    engine, large = _engine(pair, tokenizer, Lagged(99))
    scripted(engine, {"A": [0, 1, 1, 0, 1]})
    steps = run_steps(engine)
    assert steps == [{"A"}] * 5 and len(large.calls) == 3


def test_a_request_that_must_catch_up_now_lands_the_flight_first(pair, tokenizer):
    """V verifies its drafts: its catch-up runs in the step. A's flight (launched at step 2,
    99 steps long) is landed at the start of step 3, before V's catch-up uses M_L."""
    engine, large = _engine(pair, tokenizer, Lagged(99))
    scripted(engine, {"A": [0, 1, 0, 0], "C": [0] * 4})
    scripted(engine, {"V": [0, 0, 1, 0]}, verification=Verification.KL, tolerance=1e9)
    steps = run_steps(engine)
    assert steps[1] == {"C", "V"} and steps[2] == {"A", "C", "V"}
    assert large.calls[:2] == [["A"], ["V"]]


def test_a_request_cancelled_in_flight_is_closed_when_it_lands(pair, tokenizer):
    """A flies at step 2 and is cancelled: it stays live (has_work) until its flight lands,
    in the step after C and D end, which closes its sessions and commits nothing."""
    engine, large = _engine(pair, tokenizer, Lagged(2))
    scripted(engine, {"A": [0, 1, 0], "C": [0] * 3, "D": [0] * 3})
    engine.step()
    engine.step()  # A flies
    engine.cancel("A")
    assert "A" in engine.live_ids() and large.runner.length("A") > 0
    steps = run_steps(engine)
    assert steps == [set("CD"), set()]
    assert "A" not in engine.live_ids()
    assert "A" not in large.runner.request_ids()  # its session is closed


def test_a_failed_catch_up_in_flight_commits_the_small_token(pair, tokenizer):
    """The forward A's flight runs gets no reply: A is degraded and its step takes M_S's
    token drawn when it was routed, as in the synchronous loop."""
    runs = {}
    for overlap in (False, True):
        engine, large = _engine(pair, tokenizer, Lagged(2), fail_at=1, overlap=overlap)
        scripted(engine, {"A": [0, 1, 1, 0], **{c: [0] * 4 for c in "CDEF"}})
        run_steps(engine)
        a = engine.finish("A")
        runs[overlap] = (a.token_ids, a.sources, a.degraded, large.calls)
    assert runs[True] == runs[False]
    assert runs[True][1] == (0, 0, 0, 0) and runs[True][2] and runs[True][3] == [["A"]]


def test_an_error_in_flight_is_raised_by_the_step_and_nothing_is_lost(pair, tokenizer):
    """A catch-up that raises what the loop does not handle: the step raises it, and A is
    back among the live requests, still waiting to catch up."""

    class Broken(Lagged):
        def submit(self, catch):
            self.launched += 1

            def fail():
                raise RuntimeError("device lost")

            return _Raising(fail)

    @dataclass
    class _Raising:
        fn: object

        def done(self) -> bool:
            return True

        def result(self):
            return self.fn()

    engine, _ = _engine(pair, tokenizer, Broken(1))
    scripted(engine, {"A": [0, 1, 0], "C": [0] * 3})
    engine.step()
    engine.step()  # A flies
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert "A" in engine.live_ids() and engine._live["A"].waiting is not None


def test_overlap_takes_two_models(pair, tokenizer):
    small, large = pair
    runners = [ModelRunner(m, n) for m, n in ((small, "s"), (large, "m"), (large, "l"))]
    with pytest.raises(ValueError, match="two models"):
        BackoffEngine(runners, tokenizer, overlap_catch_ups=True)


def test_a_side_stream_over_static_kv_only(pair, tokenizer):
    """side_stream_device: a flight gets a CUDA stream of its own (on M_L's device) only over
    static KV slots, which never reallocate; per-session caches reallocate at every extend, so
    their flights stay on the loop's stream (no device: a plain worker thread)."""
    small, large = pair
    static = StaticRunner(large, "large", kv_budget_tokens=4 * 64, max_len=64)
    assert side_stream_device(static) == static.device == torch.device("cpu")
    assert side_stream_device(ModelRunner(large, "large")) is None
    engine = BackoffEngine([ModelRunner(small, "small"), ModelRunner(large, "large")], tokenizer)
    engine.overlap_catch_ups = True
    assert engine.launcher.stream is None and engine.launcher.loop_stream is None  # the loop: the caller's
    for first in ("loop", "flight"):  # no stream to prioritise without CUDA
        engine.launcher.first = first
        assert engine.launcher.stream is None and engine.launcher.loop_stream is None
    with pytest.raises(ValueError, match="first must be one of"):
        engine.launcher.first = "large"


def test_turned_on_and_off_between_steps(pair, tokenizer):
    """overlap_catch_ups may change between steps, not while a catch-up is in flight; the
    tokens are the same whichever steps had it."""
    scripts = {"A": [0, 1, 0, 1, 0], "B": [0, 0, 1, 1, 0], "C": [0] * 5}
    engine, large = _engine(pair, tokenizer, Lagged(2), overlap=False)
    scripted(engine, scripts)
    engine.step()
    engine.overlap_catch_ups = True
    engine.step()  # A flies
    with pytest.raises(RuntimeError, match="in flight"):
        engine.overlap_catch_ups = False
    while engine.flights.busy:
        engine.step()
    engine.overlap_catch_ups = False
    run_steps(engine)
    sync, _ = _engine(pair, tokenizer, overlap=False)
    scripted(sync, scripts)
    run_steps(sync)
    for rid in scripts:
        assert engine.finish(rid).token_ids == sync.finish(rid).token_ids


def test_a_request_cancelled_while_its_catch_up_runs_is_closed_after_it(pair, tokenizer):
    """A real worker thread whose catch-up is held until released: A is cancelled while its
    catch-up is out; the step that waits for it closes A's sessions only once the catch-up
    has run, which therefore extends an open session."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    release = threading.Event()

    class Held:
        pool = ThreadPoolExecutor(max_workers=1)

        def submit(self, catch):
            return self.pool.submit(lambda: release.wait(10) and catch())

    engine, large = _engine(pair, tokenizer, Held())
    errors, extend = [], large.runner.extend

    def recording(*args, **kwargs):
        try:
            return extend(*args, **kwargs)
        except Exception as exc:
            errors.append(exc)
            raise

    large.runner.extend = recording
    scripted(engine, {"A": [0, 1, 0], "C": [0, 0, 0]})
    engine.step()
    engine.step()  # A flies, held
    engine.cancel("A")
    threading.Timer(0.3, release.set).start()
    steps = run_steps(engine)  # C's last step; then nothing else to step: the loop waits
    assert steps == [{"C"}, set()]
    assert large.calls == [["A"]] and errors == []
    assert engine.live_ids() == ["C"] and "A" not in large.runner.request_ids()


class _Stream:
    """A CUDA stream's bookkeeping without a GPU: what waited for what (`log`)."""

    device = torch.device("cuda", 0)

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def record_event(self) -> str:
        self.log.append(f"{self.name} recorded")
        return f"{self.name}'s event {len(self.log)}"

    def wait_event(self, event: str) -> None:
        self.log.append(f"{self.name} waits for {event}")


def test_a_flight_on_a_side_stream_waits_for_what_the_loop_queued_at_launch_and_the_loop_for_it(monkeypatch):
    """ThreadLauncher on streams that record instead of a GPU: the side stream waits for an
    event the loop recorded at submit (not for the loop's stream when the worker gets to run,
    by then holding later steps), and the loop waits for the side stream when the flight lands,
    also when the catch-up raised (its kernels may still run)."""
    log: list[str] = []
    loop, side = _Stream("loop", log), _Stream("side", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: loop)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    launcher = ThreadLauncher(None)
    launcher._streams = {0: side}  # as on CUDA: first=None flies on the priority-0 stream
    started = threading.Event()
    release = threading.Event()

    def catch():
        started.set()
        release.wait(5)
        log.append("catch-up ran")
        return {}

    handle = launcher.submit(catch)
    started.wait(5)
    log.append("loop queued its next step")  # while the flight is out
    release.set()
    assert handle.result() == {}
    assert log == [
        "loop recorded",
        "side waits for loop's event 1",
        "loop queued its next step",
        "catch-up ran",
        "loop waits for side",
    ]
    log.clear()
    failing = launcher.submit(lambda: (_ for _ in ()).throw(RuntimeError("catch-up failed")))
    with pytest.raises(RuntimeError):
        failing.result()
    assert log[-1] == "loop waits for side"


def test_the_loops_calls_run_on_the_launchers_loop_stream(pair, tokenizer, monkeypatch):
    """flight.on_loop_stream, on streams that record instead of a GPU: with flights on and a
    launcher's loop stream (ThreadLauncher first="loop" on CUDA), each of the engine's device
    calls (submit_many, step, finish) runs M_S on it, the loop's stream waiting for the
    caller's on the way in and the caller's for the loop's on the way out; without one (or
    flights off), on the caller's, nothing waited for."""
    log: list[str] = []
    caller, loop = _Stream("caller", log), _Stream("loop", log)
    current = [caller]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    launcher = Lagged(2)
    engine, _ = _engine(pair, tokenizer, launcher)
    small, extend, seen = engine.models[0], engine.models[0].extend, []
    monkeypatch.setattr(small, "extend", lambda *a, **k: seen.append(current[-1].name) or extend(*a, **k))
    reqs = [request((3 + i, 4, 5), 8, "random", seed=i, temperature=1.0, rate=0.5) for i in range(3)]

    launcher.loop_stream = loop
    engine.generate_many(reqs)
    calls = len(log) // 2
    assert seen and set(seen) == {"loop"} and current == [caller]
    assert calls > 3 and log == ["loop waits for caller", "caller waits for loop"] * calls
    for loop_stream, overlap in ((None, True), (loop, False)):  # no loop stream; flights off
        launcher.loop_stream, engine.overlap_catch_ups = loop_stream, overlap
        log.clear(), seen.clear()
        engine.generate_many(reqs)
        assert seen and set(seen) == {"caller"} and log == []
