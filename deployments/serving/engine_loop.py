"""One thread owns the BackoffEngine; the event loop talks to it through queues (no Ray).

The engine is not thread-safe, and its `step()` advances ALL live requests by one token in
batched forwards, so one thread loops `step()` while there is work:
  1. drain commands (admit / cancel), reading the live policy ONCE for the whole step
  2. step every live request (M_S batched; catch-ups batched per level)
  3. hand each request's TokenEvent to its stream; finished requests get their result
A failure while handling one request ends that request alone (backoff_core/engine/isolation.py:
`finish` raises its error, which becomes its Failed); the other requests go on.
Each stream is an asyncio.Queue fed with `call_soon_threadsafe`: items are Admitted,
TokenEvent ..., GenerationResult, or Rejected / Failed instead (deployments/serving/outcomes.py).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Generic, TypeVar

from backoff_core.types import GenerationRequest, GenerationResult
from deployments.serving.outcomes import Admitted, Failed, Rejected, error_item

if TYPE_CHECKING:
    from backoff_core.engine.engine import BackoffEngine

log = logging.getLogger(__name__)
Policy = TypeVar("Policy")


class Items(asyncio.Queue):
    """One stream's items, in order; `ended` is set once its last one (the result, Rejected or
    Failed) is queued, so a reader holding tokens back (the message budget) can send at once."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = asyncio.Event()

    def put_nowait(self, item) -> None:
        super().put_nowait(item)
        if isinstance(item, (GenerationResult, Rejected, Failed)):
            self.ended.set()


class _Sink:
    """Thread-safe handle on one stream's Items."""

    def __init__(self, loop: asyncio.AbstractEventLoop, q: Items, tokens: bool) -> None:
        self.loop, self.queue = loop, q
        self.tokens = tokens  # False: only Admitted and the result (a unary request)

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


def _id(request) -> str:
    return str(getattr(request, "request_id", "") or "")


def _deliver(items: list[tuple[_Sink, object]]) -> None:
    """Put a step's items into their streams' queues with ONE wake-up per event loop (not one
    per stream: a step of 64 streams would wake it 64 times, each a callback and a lock).
    FIFO with every other call_soon_threadsafe, so a stream's order is kept."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, object]]] = {}
    for sink, item in items:
        by_loop.setdefault(sink.loop, []).append((sink, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


def _put_all(batch: list[tuple[_Sink, object]]) -> None:
    for sink, item in batch:
        sink.queue.put_nowait(item)


class EngineLoop(Generic[Policy]):
    """admit(request, policy) -> GenerationRequest runs on the engine thread (it tokenizes)."""

    def __init__(
        self,
        engine: BackoffEngine,
        admit: Callable[[object, Policy], GenerationRequest],
        policy: Policy,
        on_finish: Callable[[GenerationResult], None] | None = None,
    ) -> None:
        self.engine = engine
        self.admit = admit
        self.policy = policy  # replaced whole (one reference store) by reconfigure
        self.on_finish = on_finish
        self.steps = 0
        self.last_step_s = 0.0
        self.busy_s = 0.0  # time spent in steps
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backoff-engine", daemon=True)

    # -- event-loop side --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout_s)

    def submit(self, request, tokens: bool = True) -> Items:
        """Queue a request; returns the queue its stream items arrive on (TokenEvents only
        if `tokens`: a unary request needs none, and each one costs the event loop)."""
        q = Items()
        self._commands.put(("submit", request, _Sink(asyncio.get_running_loop(), q, tokens)))
        return q

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id, None))

    def live(self) -> int:
        return len(self._sinks)

    def live_ids(self) -> tuple[str, ...]:
        return tuple(self._sinks)

    # -- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain(block=not self.engine.has_work())
            if self.engine.has_work():
                self._step()
            for request_id in self.engine.finished_ids():  # done at admission (max_tokens 0: a scored prompt)
                self._finish(request_id)
        for request_id in list(self._sinks):
            self._fail(request_id, "the server is shutting down")

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block, timeout=0.5)
        except queue.Empty:
            return
        policy = self.policy  # 1. read once, after any wait: a reconfigure never tears a step
        arrived: list[tuple[object, _Sink]] = []  # submits waiting together: admitted in one prefill
        while True:
            kind, arg, sink = command
            if kind == "submit":
                arrived.append((arg, sink))
            elif kind == "cancel":
                self._admit_all(arrived, policy)  # a cancel may name one of them
                arrived = []
                self._cancel(arg)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._admit_all(arrived, policy)
                return

    def _admit_all(self, arrived: list[tuple[object, _Sink]], policy) -> None:
        """Requests that arrived together (a batch's prompts, concurrent clients) admitted
        together: one prefill (and prompt scoring) forward per model (engine.submit_many).
        That is all or none, so when it refuses, each is admitted alone and gets its own answer."""
        ready = []
        for request, sink in arrived:
            try:
                ready.append((request, sink, self.admit(request, policy)))
            except Exception as exc:  # noqa: BLE001 - its prompt or settings (a ValueError): this one alone
                sink.put(error_item(exc, admitted=False, request_id=_id(request)))
        submit_many = getattr(self.engine, "submit_many", None)  # a stand-in engine may have submit alone
        if len(ready) > 1 and submit_many is not None:
            try:
                ids = submit_many([g for _, _, g in ready])
            except ValueError:  # one of them is refused: find out which, one by one
                pass
            except Exception as exc:  # noqa: BLE001 - no request's fault (a model down, KV full): all alike
                for request, sink, _ in ready:
                    sink.put(error_item(exc, admitted=False, request_id=_id(request)))
                return
            else:
                for (request, sink, generation), request_id in zip(ready, ids):
                    self._admitted(request, sink, generation, request_id)
                return
        for request, sink, generation in ready:
            self._admit(request, sink, generation)

    def _admitted(self, request, sink: _Sink, generation: GenerationRequest, request_id: str) -> None:
        self._sinks[request_id] = sink
        echo = generation.prompt_ids if getattr(request, "echo", False) else None
        sink.put(Admitted(request_id, len(generation.prompt_ids), echo))

    def _admit(self, request, sink: _Sink, generation: GenerationRequest) -> None:
        try:
            request_id = self.engine.submit(generation)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the loop goes on
            sink.put(error_item(exc, admitted=False, request_id=_id(request)))
            return
        self._admitted(request, sink, generation, request_id)

    def _cancel(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            self.engine.cancel(request_id)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            events = self.engine.step()  # 2.
        except Exception as exc:  # noqa: BLE001 - no one request to blame (a bug in the step itself):
            log.exception("step failed")  # fail the step's requests, keep serving
            for request_id in list(self._sinks):
                self._fail(request_id, f"{type(exc).__name__}: {exc}")
            return
        self.steps += 1
        _deliver(
            [
                (sink, event)
                for request_id, event in events.items()  # 3.
                if (sink := self._sinks.get(request_id)) is not None and sink.tokens
            ]
        )
        for request_id in self.engine.finished_ids():
            self._finish(request_id)
        self.last_step_s = time.perf_counter() - start
        self.busy_s += self.last_step_s

    def _finish(self, request_id: str) -> None:
        """Hand a finished request its result, or the error that ended it alone."""
        sink = self._sinks.pop(request_id, None)
        try:
            result = self.engine.finish(request_id)
        except Exception as exc:  # noqa: BLE001 - this request's own failure; the others go on
            item = error_item(exc, admitted=True, request_id=request_id)
        else:
            item = result
            if self.on_finish is not None:
                try:
                    self.on_finish(result)
                except Exception:  # noqa: BLE001 - metrics must not cost the request its answer
                    log.exception("on_finish failed")
        if sink is not None:
            sink.put(item)

    def _fail(self, request_id: str, message: str) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.put(Failed(message))
        self.engine.cancel(request_id)
