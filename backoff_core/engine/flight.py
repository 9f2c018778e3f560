"""Catch-ups in flight (`overlap_catch_ups`, docs/batched-catch-ups.md): a batched catch-up
of plain routed requests runs beside M_S's next steps instead of between two of them.

The synchronous loop alternates: M_S steps, then M_L catches up while M_S waits, then M_S
steps again. M_S's step is kernel-launch-bound (the device mostly idle in it), and with M_L
on a GPU of its own, one of the two is always idle. In flight, the catch-up runs on a worker
thread (on CUDA, on a stream of its own) while the loop steps every request not in it. Its
requests leave the loop's live table until it lands, at the start of a later step, and then
commit the token of the step that routed them, as a request that waited for a batched
catch-up does (hold.py: their `Live.waiting` keeps M_S's token and the router's score).
Every draw is a pure function of (seed, position), so the tokens are the synchronous loop's.

What flies: a group of requests that may wait (CatchUpHold.may_wait: a plain routed step),
one flight at a time, with two models. While it is out, the next group routed to M_L waits
for it. It lands, waited for if need be, when nothing else could step, or when the loop runs
M_L itself: a request that must catch up now (verification, an oracle, a forced level: their
catch-ups run in the step) or a chunk of a long catch-up; an admission that prefills M_L
waits for it to be done (`settle`).

On one GPU the flight's M_L forward and M_S's steps share the device. M_S's step is a chain
of small launch-bound kernels; queued behind a wave of M_L's wide GEMMs each waits for it,
and each slows the flight that its requests wait for. `ThreadLauncher.first` can have the GPU
schedule one side's blocks first by stream priority (a CUDA graph replays at the priority of
the stream it is launched into): the loop's (`on_loop_stream` enters its stream) or the
flight's. Which is faster, if either, is for a GPU to measure (benchmarks/batch_scaling.py has
a row of each; benchmarks/gpu_sim_sharing.py what each slowdown would cost), so neither is the
default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from backoff_core.engine.backends import Backend
from backoff_core.engine.catchup import CatchUpper, Outcome
from backoff_core.engine.hold import CatchUpHold
from backoff_core.engine.propose import Decided, Proposal
from backoff_core.engine.state import Live
from backoff_core.runners.static import StaticRunner

Catch = Callable[[], dict[str, Outcome]]  # one catch-up: CatchUpper.run bound to its level and group
HIGHEST_PRIORITY = -100  # torch maps a priority past the device's range to its end: the highest
FIRST = (None, "loop", "flight")  # ThreadLauncher.first: whose kernels the GPU schedules first


class Handle(Protocol):
    """A launched catch-up (concurrent.futures.Future's surface)."""

    def done(self) -> bool: ...

    def result(self) -> dict[str, Outcome]: ...


class Launcher(Protocol):
    def submit(self, catch: Catch) -> Handle: ...


def side_stream_device(large: Backend) -> torch.device | None:
    """Where a catch-up in flight gets a CUDA stream of its own: M_L's device, over static KV
    storage only. Per-session caches reallocate their tensors at every extend, and a tensor
    freed by the flight's thread while the loop's stream still reads it (or the reverse) could
    be handed to the other stream early; there the flight runs on the worker thread on the
    loop's stream (its host work overlaps, its kernels queue behind the loop's)."""
    return large.device if isinstance(large, StaticRunner) else None


class ThreadLauncher:
    """One worker thread; on CUDA its kernels go to a side stream, so that they overlap the
    step loop's own (M_S's step), and what it hands back is safe to use on the loop's stream.

    first (on CUDA): whose kernels the GPU schedules first where both have blocks waiting, by
    stream priority. None (the default): neither, the loop on the caller's stream and the side
    stream of the same priority. "loop": the loop's calls run on `loop_stream`, of the highest
    priority (entered by `on_loop_stream`). "flight": the side stream is of the highest. It may
    change between steps while no flight is out (benchmarks/batch_scaling.py has a row of each)."""

    def __init__(self, device: torch.device | None, first: str | None = None) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="catch-up")
        cuda = device is not None and device.type == "cuda"
        # priority -> a stream: 0 the side stream (but where the flight goes first); the
        # highest, the stream of whichever side goes first
        self._streams = {p: torch.cuda.Stream(device, priority=p) for p in (0, HIGHEST_PRIORITY)} if cuda else {}
        self.first = first

    @property
    def first(self) -> str | None:
        return self._first

    @first.setter
    def first(self, first: str | None) -> None:
        if first not in FIRST:
            raise ValueError(f"first must be one of {FIRST}, got {first!r}")
        self._first = first

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The flights' side stream (None: no CUDA, a plain worker thread)."""
        return self._streams.get(HIGHEST_PRIORITY if self.first == "flight" else 0)

    @property
    def loop_stream(self) -> torch.cuda.Stream | None:
        """Where the loop's kernels go while flights are on (None: the caller's stream)."""
        return self._streams.get(HIGHEST_PRIORITY) if self.first == "loop" else None

    def submit(self, catch: Catch) -> Handle:
        side = self.stream
        if side is None:
            return self.pool.submit(catch)
        # what the loop queued before the launch, marked now: the worker waits for that and not
        # for the steps the loop queues before the worker thread runs (it records no later)
        queued = torch.cuda.current_stream().record_event()
        return _OnStream(self.pool.submit(self._on_stream, catch, queued, side), side)

    def _on_stream(self, catch: Catch, queued: torch.cuda.Event, side: torch.cuda.Stream) -> dict[str, Outcome]:
        side.wait_event(queued)
        with torch.cuda.stream(side):
            return catch()


def on_loop_stream(method):
    """An engine method whose kernels go to the launcher's loop stream while flights are on
    (`ThreadLauncher.loop_stream`, with first="loop"; launchers without one, and flights off:
    the caller's). The loop stream first waits for what the caller queued (weights, KV
    storage, a previous step run on another stream), and the caller's stream waits for the
    loop's work on the way out: every tensor passed between the two is ordered, whichever
    stream the next call runs on."""

    @functools.wraps(method)
    def run(engine, *args, **kwargs):
        flights = engine.flights
        stream = getattr(flights.launcher, "loop_stream", None) if flights is not None else None
        if stream is None:
            return method(engine, *args, **kwargs)
        caller = torch.cuda.current_stream(stream.device)
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                return method(engine, *args, **kwargs)
        finally:
            caller.wait_stream(stream)

    return run


@dataclass
class _OnStream:
    future: Future
    stream: torch.cuda.Stream

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> dict[str, Outcome]:
        loop = torch.cuda.current_stream()
        try:
            outcomes = self.future.result()
        finally:  # a catch-up that raised may have queued kernels too: the loop waits for them
            loop.wait_stream(self.stream)
        for outcome in outcomes.values():  # made on the side stream, freed after the loop's use
            outcome.logits.record_stream(loop)
        return outcomes


@dataclass
class Flight:
    group: dict[str, Live]  # out of the engine's live table until it lands
    handle: Handle
    cancelled: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Landed:
    """A flight back: its requests (cancelled ones apart) and the outcomes of their catch-up."""

    lives: list[Live]
    outcomes: dict[str, Outcome]  # a degraded or failed request has none


class Flights:
    """The engine's catch-ups in flight: its live table (requests in flight leave it), its
    hold (which keeps a routed step), its catch-up runner and how it closes a request."""

    def __init__(
        self,
        launcher: Launcher,
        table: dict[str, Live],
        hold: CatchUpHold,
        catch_up: CatchUpper,
        close: Callable[[Live], None],
    ) -> None:
        self.launcher = launcher
        self.table = table
        self.hold = hold
        self.catch_up = catch_up
        self.close = close
        self.out: Flight | None = None
        self.launched = 0  # catch-ups flown so far

    @property
    def busy(self) -> bool:
        return self.out is not None

    def ids(self) -> list[str]:
        return list(self.out.group) if self.out is not None else []

    def __contains__(self, request_id: str) -> bool:
        """Whether request_id is in the flight out."""
        return self.out is not None and request_id in self.out.group

    def fly(self, level: int, group: list[Live], proposal: Proposal) -> None:
        """group's catch-up (plain routed steps, none in outcomes), launched to run beside the
        next steps; or, with one out already, group waits for it to land."""
        self.hold.wait(level, group, proposal)
        if self.out is not None:
            return
        for r in group:
            del self.table[r.request_id]
        self.launched += 1
        self.out = Flight({r.request_id: r for r in group}, self.launcher.submit(self._catch(level, group)))

    def catch_ups(self, live: list[Live], step: Decided, landed: Landed | None, num_levels: int) -> list[Live]:
        """Stage 5 with catch-ups in flight: a landed flight's requests take up the step that
        routed them; per level, the group the hold releases flies if all of it may wait, else
        catches up now (step.outcomes gets theirs). Returns the requests that commit in this
        step: not the ones that wait or fly; if nothing else would, the flight's, waited for."""
        waiting = self.hold.take_waiting(live, step.levels)
        if landed is not None:
            self.rejoin(landed, step.outcomes, step.proposal)
        for level, group in self.hold.groups(live, step, waiting, num_levels):
            if group and all(self.hold.may_wait(r) for r in group):
                self.fly(level, group, step.proposal)
            else:
                step.outcomes.update(self.catch_up.run(level, group))
        live = [r for r in live if r.waiting is None]
        if self.busy and not live:  # nothing else commits: wait
            landed = self.land(wait=True)
            self.rejoin(landed, step.outcomes, step.proposal)
            live = landed.lives
        return live

    def _catch(self, level: int, group: list[Live]) -> Catch:
        return lambda: self.catch_up.run(level, group)

    def land(self, wait: bool = False) -> Landed | None:
        """The flight, if it is back, its requests in the live table again (still waiting:
        `rejoin` puts them in the step). Waited for (with wait, or) when nothing else could
        step, or when the loop runs M_L itself this step. None: none out, or not yet back."""
        if self.out is None:
            return None
        rest = [r for r in self.table.values() if not r.done]
        wait = (
            wait
            or not any(r.waiting is None for r in rest)
            or any(not r.degraded and not self.hold.may_wait(r) for r in rest)  # catches up in its step
            or any(level > 0 for r in rest for level in r.backlog)  # a chunk of a long catch-up
        )
        if not (wait or self.out.handle.done()):
            return None
        flight, self.out = self.out, None
        kept = [r for rid, r in flight.group.items() if rid not in flight.cancelled]
        try:  # what the loop does not handle is raised, as in a step
            outcomes = flight.handle.result()
        finally:  # the catch-up is over: the cancelled are closed, the others back (still
            for rid in flight.cancelled:  # waiting, after an error: their catch-up is taken again)
                self.close(flight.group[rid])
            self.table.update((r.request_id, r) for r in kept)
        return Landed(kept, {r.request_id: outcomes[r.request_id] for r in kept if r.request_id in outcomes})

    def rejoin(self, landed: Landed, outcomes: dict[str, Outcome], proposal: Proposal) -> None:
        """Landed requests take up the step that routed them, with their catch-up's outcomes."""
        outcomes.update(landed.outcomes)
        self.hold.resume(landed.lives, proposal)

    def settle(self) -> None:
        """Wait until the flight out (if any) is done, without landing it: before the loop runs
        the flight's model itself (on CUDA the two would share its graphs' static buffers
        from two streams)."""
        if self.out is not None:
            try:
                self.out.handle.result()
            except Exception:  # noqa: BLE001 - raised when it lands
                pass

    def cancel(self, request_id: str) -> bool:
        """Whether request_id is in flight (then it is closed when the flight lands)."""
        if request_id not in self:
            return False
        self.out.cancelled.add(request_id)
        return True
