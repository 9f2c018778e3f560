"""M_S's next step launched ahead (`launch_ahead`): the host's work between two M_S steps
hidden behind M_S's forward.

Without it the device and the host take turns: M_S's forward and the draw run while the
host waits to read the tokens, then the host decides, catches up, commits and lays out the
next forward while the device waits (on an H100, ~1.7 ms a step at 64 streams against a
2.4 ms forward: docs/gpu.md). With it, as soon as the draw (and the copy of its tokens) is
queued, M_S's forward of the next step is queued behind it, reading the drawn tokens where
they lie (StaticRunner.extend(on_device=...)); the host's read waits for the copy, not for
that forward (host.start_read), and the host's decisions and commit run while the device
runs it. vLLM's and SGLang's overlap schedulers hide the CPU's scheduling the same way.

A row launched ahead fed, at its position p, the token drawn there. The next step takes its
logits if the step committed that same token at p (it stayed small, or the larger model's
token was the same) and M_S's cache has not moved since; otherwise (routed and waiting,
rolled back, a stall undone) M_S's session is cropped back: in a static slot a crop moves a
length, and the next forward writes over position p. A finished request's row is dropped
with its sessions.

A request that must step and was not launched (a new one, one whose catch-up just ran) is
deferred a step: it rides this step's launch, its one pending token uploaded beside the
drawn ones, rather than cost a second M_S forward now (most of a step's device time). Only
where nothing launched ahead is still good does the step run M_S as without it.

Every draw is a pure function of (seed, position), the routers' coins too, so each request
gets the tokens it gets without launching ahead; only when steps commit them moves. What is
launched: the rows of plain requests (those the hold lets wait: no verification, oracle or
forced level, not degraded) with room for one more position in M_S's slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from backoff_core.engine.backends import Backend
from backoff_core.engine.propose import SmallOut, small_step
from backoff_core.engine.state import Live
from backoff_core.runners.extension import last_rows

log = logging.getLogger(__name__)


@dataclass
class Launched:
    """M_S's forward queued ahead of its step, and what each of its rows fed."""

    small: SmallOut  # one row per launched request, in launch order
    lives: dict[str, Live]  # request id -> the request (by identity: an id may come back)
    at: dict[str, int]  # request id -> the position its row fed (M_S's fed[0] at launch)
    host: dict[str, int]  # request id -> the token fed, for rows whose token the host knew
    seconds: float  # the launch's host time
    drawn: dict[str, int] = field(default_factory=dict)  # the others' tokens, once read back


class LaunchAhead:
    """Launches M_S's steps ahead (the module's docstring); the engine holds one."""

    def __init__(self, model: Backend, may_wait: Callable[[Live], bool]) -> None:
        if not supported(model):
            raise ValueError(
                f"launch_ahead needs M_S on static KV (a runner that reads ids on the device); "
                f"{getattr(model, 'name', model)!r} is not"
            )
        self.model = model
        self.may_wait = may_wait  # hold.may_wait: a plain routed step
        self.pending: Launched | None = None
        self.rows_launched = self.rows_used = 0  # rows launched ahead / taken by a step

    def launchable(self, r: Live) -> bool:
        """Whether r's next M_S step may be launched now: stepping, room for a position, plain."""
        return (
            r.waiting is None
            and not r.backlog
            and r.failure is None
            and r.fed[0] < self.model.max_positions
            and self.may_wait(r)
        )

    def settle(self, live: Mapping[str, Live]) -> Launched | None:
        """At a step's start: the last launch with `at` cut to the rows it still holds good;
        the others' M_S sessions are cropped back. None: nothing good."""
        launched, self.pending = self.pending, None
        if launched is None:
            return None
        good = {}
        for request_id, p in launched.at.items():
            r = launched.lives[request_id]
            if live.get(request_id) is not r or r.done:
                continue  # gone (its sessions are closed) or finished
            # M_S's cache as at the launch, one token committed since: the one fed (a request
            # waiting, rolled back or stalled since fails this; one not stepping now is cropped
            # in small_step)
            token = launched.host.get(request_id, launched.drawn.get(request_id))
            if r.fed[0] == p and len(r.tokens) == p + 1 and r.tokens[p] == token:
                good[request_id] = p
            else:
                self.crop(r)
        if not good:
            return None
        return Launched(launched.small, launched.lives, good, launched.host, launched.seconds)

    def drop(self, live: Mapping[str, Live]) -> None:
        """Forget the last launch, its rows cropped back (launching ahead turned off)."""
        launched, self.pending = self.pending, None
        for request_id, r in launched.lives.items() if launched is not None else ():
            if live.get(request_id) is r:
                self.crop(r)

    def crop(self, r: Live) -> None:
        """M_S's session of r back to what the engine fed it (a launched row not taken)."""
        try:
            self.model.crop(r.request_id, r.fed[0])
        except (KeyError, ValueError):  # no session, or shorter already: nothing launched is left
            pass

    def small_step(
        self, models: list[Backend], stepping: list[Live], launched: Launched | None
    ) -> tuple[SmallOut, list[Live]]:
        """Stage 2 with a launch settled: (M_S's outputs of the requests that step, those
        deferred to this step's launch). The launched rows step on their logits; the others
        that may be launched wait a step; the rest step now."""
        if launched is None:
            return small_step(models, stepping), []
        covered = [r for r in stepping if r.request_id in launched.at]
        for request_id in launched.at.keys() - {r.request_id for r in covered}:  # settled, yet not stepping
            self.crop(launched.lives[request_id])
        if not covered:
            return small_step(models, stepping), []
        deferred, now = [], []  # the others: one pending token and launchable, or not
        for r in stepping:
            if r.request_id not in launched.at:
                (deferred if len(r.tokens) - r.fed[0] == 1 and self.launchable(r) else now).append(r)
        ids = [r.request_id for r in covered]
        small = launched.small
        if ids != list(small.rows):  # some rows not taken, or in another order: a gather
            logits, hidden = small.take(ids)
            small = SmallOut(logits, hidden, {request_id: i for i, request_id in enumerate(ids)})
        self.rows_used += len(covered)
        for r in covered:
            r.fed[0] = len(r.tokens)
            r.stats.small_times.append(launched.seconds)
        return (small.merged(small_step(models, now)) if now else small), deferred

    def launcher(self, stepped: list[Live], deferred: list[Live]) -> Callable[[torch.Tensor], None] | None:
        """For propose: given stepped's drawn tokens [n] on the device, launch the next M_S
        step of the launchable ones and of deferred (launchable: small_step chose them, and
        nothing of theirs changes before propose). None: nothing to launch."""
        go = [i for i, r in enumerate(stepped) if self.launchable(r)]
        if not go and not deferred:
            return None
        layers = {stepped[i].router.hidden_layer for i in go} | {r.router.hidden_layer for r in deferred}
        if len(layers - {None}) > 1:
            return None  # one forward serves one classifier layer (small_step's rule)
        layer = next(iter(layers - {None}), None)

        def launch(drawn: torch.Tensor) -> None:  # drawn: [len(stepped)] long
            start = time.perf_counter()
            rows = [stepped[i] for i in go] + deferred
            ids = drawn if len(go) == len(stepped) else drawn.index_select(0, _index(go, drawn.device))
            host = {r.request_id: r.tokens[r.fed[0]] for r in deferred}
            if deferred:
                ids = torch.cat([ids, torch.tensor(list(host.values())).to(drawn.device, non_blocking=True)])
            items = [(r.request_id, [host.get(r.request_id, 0)]) for r in rows]  # placeholders: drawn ids
            try:
                out = self.model.extend(items, hidden_layer=layer, last_only=True, on_device=ids)
            except Exception as exc:  # noqa: BLE001 - the step goes on; the next steps M_S as without
                log.warning("M_S's step launched ahead failed (%s: %s); stepping without", type(exc).__name__, exc)
                return
            logits, hidden = last_rows(out)  # [n, V], [n, d] | None
            small = SmallOut(logits, hidden, {r.request_id: i for i, r in enumerate(rows)})
            at = {r.request_id: r.fed[0] for r in rows}
            self.pending = Launched(small, {r.request_id: r for r in rows}, at, host, time.perf_counter() - start)
            self.rows_launched += len(rows)

        return launch

    def read(self, tokens: Mapping[str, int]) -> None:
        """After propose: the drawn tokens the launched rows fed, as read back."""
        if self.pending is not None:
            self.pending.drawn = {rid: tokens[rid] for rid in self.pending.at if rid in tokens}


def supported(model: Backend) -> bool:
    """Whether model's forward reads new ids from the device (StaticRunner)."""
    return bool(getattr(model, "extends_on_device", False))


def resolve(setting: bool | str, model: Backend, overlap_catch_ups: bool = False) -> bool:
    """The `launch_ahead` setting made a choice for M_S `model`.

    - "auto" (the default where it is served): on where M_S is on static KV on CUDA and the
      catch-ups are not in flight (`overlap_catch_ups`, which does not go with it). On the
      CPU nothing runs beside the host, so launching ahead would add its bookkeeping only.
      Measured on an H200 (docs/gpu.md, the fifth run): +4-7% tok/s at 64 streams, the
      device's idle between steps 76 -> 28 ms of ~510.
    - True: wherever M_S is on static KV; elsewhere off, with a warning.
    - False: never.
    """
    if setting == "auto":
        device = getattr(model, "device", None)
        return not overlap_catch_ups and supported(model) and getattr(device, "type", None) == "cuda"
    if setting not in (True, False):
        raise ValueError(f"launch_ahead is auto, true or false, not {setting!r}")
    if setting and not supported(model):
        log.warning(
            "launch_ahead: M_S keeps per-session caches here (no static KV), so its steps are not launched ahead"
        )
        return False
    return bool(setting)


def _index(at: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(at).to(device, non_blocking=True)
