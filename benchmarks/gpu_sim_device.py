"""The simulated device of benchmarks/gpu_sim.py: a clock of GPU + host time, CUDA graphs
replayed eagerly on the CPU whose replays cost what a GPU run measured, every forward of a
runner logged and charged to the clock, and catch-ups in flight on a timeline of M_L's own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

from backoff_core.runners.cuda_graphs import CudaGraphs
from backoff_core.runners.graph_plan import GraphKey
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_ragged import RaggedKey


@dataclass
class SimClock:
    """Seconds of simulated GPU + host time; the engine reads `now` once a step."""

    t: float = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms / 1e3


@dataclass
class _SimFlight:
    outcomes: dict
    end: float  # when M_L's timeline finishes it (s)
    clock: SimClock  # the step loop's

    def done(self) -> bool:
        return self.clock.t >= self.end

    def result(self) -> dict:
        self.clock.t = max(self.clock.t, self.end)  # the loop waits for it
        return self.outcomes


FAIR = (2.0, 2.0)  # SimLauncher sharing of one GPU shared fairly: each at half speed beside the other


@dataclass
class AheadDevice:
    """M_S's steps launched ahead (engine `launch_ahead`, ahead.py) on the simulated clock: a
    launched forward is queued on the device (`free`: when it is done) while the host's clock
    goes on, so the step's host work after its read runs beside it; the step's own read waits
    for the forward launched the step before (its draw is queued behind it), and every forward
    the host waits for (a catch-up, an M_S step not launched ahead) starts once the device is
    free. One stream: nothing runs beside anything else on the device."""

    clock: SimClock
    free: float = 0.0  # when the device has done what was queued (s)
    launches: int = 0

    def launched(self, ms: float) -> None:
        self.sync()  # the read right after the launch waits for the last launch (and its draw)
        self.free = self.clock.t + ms / 1e3
        self.launches += 1

    def sync(self) -> None:
        """The host waits for the device (a read)."""
        self.clock.t = max(self.clock.t, self.free)

    def then(self, advance: Callable[[float], None]) -> Callable[[float], None]:
        """advance (a forward the host waits for), once the device is free."""

        def waited(ms: float) -> None:
            self.sync()
            advance(ms)

        return waited


class SimLauncher:
    """Catch-ups in flight (engine `overlap_catch_ups`) on the simulated clock: a flight's
    catch-up runs at once on the CPU, its M_L forwards on M_L's own timeline (`large`), which
    starts at the launch or when M_L's last flight ends; it is done once the loop's clock
    passes its end, and waiting for it moves the loop's clock there. M_L forwards outside a
    flight (landed first) are on the loop's clock.

    sharing None: the two timelines never slow each other, exact for M_L on a GPU of its own
    and the best case for two streams on one GPU. sharing (a, b): one GPU, where an M_S
    forward (`small`) beside a flight runs a times slower, and the flight b times slower
    while it does. An M_S forward of s ms beside r ms of M_L left: if s*a <= r*b, it ends
    after s*a and pushes the flight's end by s*a*(1 - 1/b); else the flight ends after r*b and
    M_S's forward after r*b + s - r*b/a. FAIR = (2, 2), half speed each; gpu_check.py's
    `sharing` probe measures a and b on a GPU (both replayed side by side)."""

    def __init__(self, clock: SimClock, sharing: tuple[float, float] | None = None) -> None:
        self.clock = clock
        self.sharing = sharing
        self.large = SimClock()
        self.flying = False
        self.out: _SimFlight | None = None  # the last flight launched

    def advance(self, ms: float) -> None:  # M_L's forwards' clock
        (self.large if self.flying else self.clock).advance(ms)

    def small(self, ms: float) -> None:  # M_S's forwards' clock
        s = ms / 1e3
        left = self.out.end - self.clock.t if self.sharing is not None and self.out is not None else 0.0
        if left <= 0:
            self.clock.t += s
            return
        a, b = self.sharing
        if s * a <= left * b:  # M_S's forward ends first, the flight having done s*a/b of its work
            self.out.end += s * a * (1 - 1 / b)
            self.clock.t += s * a
        else:  # the flight ends first; M_S's forward has done left*b/a of its work by then
            self.out.end = self.clock.t + left * b
            self.clock.t += left * b + s - left * b / a
        self.large.t = max(self.large.t, self.out.end)

    def submit(self, catch) -> _SimFlight:
        self.large.t = max(self.large.t, self.clock.t)
        self.flying = True
        try:
            outcomes = catch()
        finally:
            self.flying = False
        self.out = _SimFlight(outcomes, self.large.t, self.clock)
        return self.out


class SimGraphs(CudaGraphs):
    """CudaGraphs on the CPU: every planned key is 'captured' (nothing runs at capture), a
    replay runs the captured body eagerly on the static buffers. The runner's buckets,
    layouts and chunking are the GPU's; only the time is simulated (`instrument`), and
    `replay_ms` (the runner's layout choice at load) answers from the cost table."""

    def __init__(self, *args, cost: Callable[[GraphKey, int, bool], float]) -> None:
        super().__init__(*args)
        self.cost = cost

    def _record(self, key: GraphKey):
        return SimpleNamespace(replay=lambda: self._body(key))

    def replay_ms(self, key: GraphKey | RaggedKey, repeats: int = 3, far=None) -> float:
        return self.cost(key, key.token_slots, False)  # far the same: a ragged forward at its dense view's price


@dataclass
class ForwardLog:
    """Every forward of one runner: (dense, rows, k, L, eager, real tokens, ms); a ragged
    forward of T tokens as (False, 1, T, 0, ...)."""

    entries: list[tuple] = field(default_factory=list)

    def by_shape(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for dense, rows, k, length, eager, real, ms in self.entries:
            name = f"{'dense' if dense else 'gather'} {rows}x{k} L{length}" if length else f"ragged {k}"
            name += " eager" if eager else ""
            s = out.setdefault(name, {"count": 0, "ms": 0.0, "real": 0})
            s["count"] += 1
            s["ms"] += ms
            s["real"] += real
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def instrument(
    runner: StaticRunner,
    advance: Callable[[float], None],
    cost: Callable[[GraphKey, int, bool], float],
    launched: Callable[[float], None] | None = None,
) -> ForwardLog:
    """Every forward of `runner` is logged and advances its clock: advance(cost(key, real tokens,
    eager)), or for a step launched ahead (ids on the device), launched(cost)."""
    log = ForwardLog()
    run = runner._run
    scratch = runner.kv.scratch

    def timed(plan, columns=None, **kwargs):  # kwargs: on_device (a step launched ahead)
        eager = columns is not None or plan.key not in runner.graphs
        real = int((plan.positions != scratch).sum())
        ms = cost(plan.key, real, eager)
        (launched if launched is not None and kwargs.get("on_device") is not None else advance)(ms)
        k = plan.key
        log.entries.append((k.dense, k.rows, k.k, k.length, eager, real, ms))
        return run(plan, columns, **kwargs)

    def ragged(key, ids, positions, token_slots, last):
        real = int((positions != scratch).sum())
        ms = cost(key, real, False)
        advance(ms)
        log.entries.append((False, 1, key.tokens, 0, False, real, ms))
        return replay_ragged(key, ids, positions, token_slots, last)

    runner._run = timed
    if runner.graphs is not None:
        replay_ragged = runner.graphs.replay_ragged
        runner.graphs.replay_ragged = ragged
    return log
