"""Step stages 1, 2 and 4 (levels known up front; propose, decide): M_S's forward over
every stepping request, batched; then the draw of their tokens and the routers' scores,
read back together in one host copy (host.py); then each routed request's level, on the host.
After stage 5, M_S's token for a request whose catch-up failed (`small_for_degraded`).
`Decided` is what a step hands from stage 4 to stages 5 and 6."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from backoff_core.engine.backends import Backend
from backoff_core.engine.catchup import Outcome
from backoff_core.engine.host import start_read
from backoff_core.engine.isolation import batched, each, reopen
from backoff_core.engine.penalties import penalties_at
from backoff_core.engine.state import Live
from backoff_core.routing.routers import DecisionFunction, StepContext
from backoff_core.runners.extension import last_rows
from backoff_core.sampling import Stream, draw, host_uniforms


@dataclass(frozen=True, eq=False)
class SmallOut:
    """M_S's step for the requests it ran, batched: row rows[sid] of each tensor is sid's."""

    logits: torch.Tensor  # [n, V] next-token logits
    hidden: torch.Tensor | None  # [n, d] at the router's layer, or None
    rows: dict[str, int]  # in row order (0, 1, ...)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.rows

    def of(self, group: list[Live]) -> list[Live]:
        """Those of group with a row here (the requests M_S stepped), in group's order."""
        return group if len(self.rows) == len(group) else [r for r in group if r.request_id in self.rows]

    def logits_of(self, request_id: str) -> torch.Tensor:
        return self.logits[self.rows[request_id]]  # [V]

    def take(self, request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [b, V], hidden [b, d] | None) of these requests, in this order: the batch
        itself when they are all its rows in order (the common step), else one gather."""
        if len(request_ids) == len(self.rows) and list(self.rows) == request_ids:  # rows: in row order
            return self.logits, self.hidden
        index = torch.tensor([self.rows[r] for r in request_ids]).to(self.logits.device, non_blocking=True)
        return self.logits.index_select(0, index), (
            self.hidden.index_select(0, index) if self.hidden is not None else None
        )

    def merged(self, other: SmallOut) -> SmallOut:
        """Both steps' rows (other's after these)."""
        if not other.rows:
            return self
        if not self.rows:
            return other
        offset = len(self.rows)
        hidden = (
            torch.cat([self.hidden, other.hidden]) if self.hidden is not None and other.hidden is not None else None
        )
        return SmallOut(
            torch.cat([self.logits, other.logits]),
            hidden,
            {**self.rows, **{r: offset + i for r, i in other.rows.items()}},
        )


NO_SMALL_STEP = SmallOut(torch.zeros(0, 0), None, {})


def small_step(models: list[Backend], group: list[Live]) -> SmallOut:
    """M_S's forward over group, batched; a request whose step failed is left out (it ended
    alone). Different routers may want different layers."""
    if not group:
        return NO_SMALL_STEP
    # one engine loads one classifier head, so at most one layer is asked for
    layers = {r.router.hidden_layer for r in group} - {None}
    if len(layers) > 1:
        raise ValueError("one step cannot serve classifier heads over different layers")
    layer = next(iter(layers), None)
    model = models[0]

    def alone(r: Live):  # after a failed batch: a fresh session, re-prefilled
        return model.extend([(r.request_id, reopen(model, 0, r))], hidden_layer=layer, last_only=True)[0]

    start = time.perf_counter()
    out = batched(
        group,
        models,
        lambda g: model.extend([(r.request_id, r.tokens[r.fed[0] :]) for r in g], hidden_layer=layer, last_only=True),
        alone,
    )
    seconds = time.perf_counter() - start
    if not out:
        return NO_SMALL_STEP
    for r in group if len(out) == len(group) else [r for r in group if r.request_id in out]:
        r.fed[0] = len(r.tokens)
        r.stats.small_times.append(seconds)
    logits, hidden = last_rows(list(out.values()))
    return SmallOut(logits, hidden, {request_id: i for i, request_id in enumerate(out)})


@dataclass(frozen=True)
class Proposal:
    """What stage 4 read back: each stepped request's M_S token, each routed one's score."""

    tokens: dict[str, int]  # the token drawn from M_S's logits: the step's token if it stays small
    scores: dict[str, float]  # the router's score (routed requests only)


# ahead.py: given a step's drawn tokens [n] on the device, queues M_S's next step (None: none)
Launch = Callable[[torch.Tensor], None] | None


class Opened(NamedTuple):
    """What stages 0 and 1 hand the rest of a step, in every mode."""

    live: list[Live]  # not done, their feed plans fed: the requests that go on
    levels: dict[str, int]  # request_id -> level decided without M_S (forced, or waiting)
    stepping: list[Live]  # the ones M_S steps (no level decided, not waiting)
    # request_id -> M_S's positions before stage 2, where a stall undoes its step ({}: chunked prefill off)
    fed: dict[str, int]


@dataclass(frozen=True)
class Decided:
    """A step through stage 4, handed to stages 5 and 6; levels and outcomes fill up in 5."""

    stepping: list[Live]  # the requests stage 1 left to M_S (some may have failed in it)
    fed: dict[str, int]  # request id -> M_S's positions before stage 2 (to undo a stall; {}: no chunks)
    small: SmallOut  # M_S's rows of those it stepped
    routed: list[Live]  # the stepped requests a router decides for
    levels: dict[str, int]  # request id -> its step's level, > 0 (M_S's: no entry)
    outcomes: dict[str, Outcome]  # request id -> its catch-up's (oracles': stage 3)
    proposal: Proposal


def propose(
    models: list[Backend],
    group: list[Live],
    routed: list[Live],
    small: SmallOut,
    large: dict[str, torch.Tensor],
    launch: Launch = None,
) -> Proposal:
    """group: requests M_S stepped (in small); routed:
    those of them a router decides for (large: sid -> the largest model's logits, for
    oracles). The tokens of the whole group are drawn in one batched draw (those that go
    large waste theirs: a draw is a pure function of seed and position) and the routers
    score their rows on the device, then ONE host copy reads tokens and scores together
    (a router whose scores are host data, `scores_on_host`, scores on the host instead).
    launch: given the group's drawn tokens [n] (on the device, not read), queues M_S's next
    step after the copy and before the host waits for it (ahead.py). If it raises, each
    request alone finds the culprit (isolation.py)."""
    all_routed = len(routed) == len(group)  # routed is a sublist of group
    routed_ids = None if all_routed else {r.request_id for r in routed}

    def together(g: Sequence[Live]) -> list[tuple[int, float | None]]:
        logits, _ = small.take([r.request_id for r in g])  # [B, V]
        seeds, positions = [r.seed for r in g], [len(r.tokens) for r in g]
        params = [r.sampling_at(p) for r, p in zip(g, positions)]
        tokens = draw(logits, params, seeds, positions, penalties=penalties_at(list(zip(g, positions)), logits))
        groups: dict[DecisionFunction, list[int]] = {}  # router -> its rows of g
        router = g[0].router
        if all_routed and all(r.router is router for r in g):  # the common step: one router for all
            groups[router] = list(range(len(g)))
        else:
            for i, r in enumerate(g):
                if routed_ids is None or r.request_id in routed_ids:
                    groups.setdefault(r.router, []).append(i)
        on_host, on_device = {}, {}  # router -> its rows' scores: host floats | a device tensor [b]
        for router, at in groups.items():
            coins = None  # the router's coin of each row (ROUTER stream), [b] float32 on the host
            if router.reads_uniforms:
                coins = host_uniforms([seeds[i] for i in at], [positions[i] for i in at], Stream.ROUTER)[:, 0]
            if router.scores_on_host:  # no upload, nothing to read back
                on_host[router] = router.host_scores(len(at), coins)
            else:
                rows = [g[i] for i in at]
                on_device[router] = router.scores(
                    _context(router, rows, logits if len(at) == len(g) else logits[at], small, large, coins)
                )
        pending = start_read(tokens, *on_device.values(), queued=launch is not None)  # else to_host's read
        if launch is not None and len(g) == len(group):  # the whole batch drew (not a culprit's retry)
            launch(tokens)
        read = pending.values()
        values = on_host | dict(zip(on_device, read[1:]))  # router -> its rows' scores, host floats
        if [len(at) for at in groups.values()] == [len(g)]:  # one router scored every row
            return list(zip(read[0], *values.values()))
        score_of: list[float | None] = [None] * len(g)
        for router, at in groups.items():
            for i, value in zip(at, values[router]):
                score_of[i] = value
        return list(zip(read[0], score_of))

    if not group:
        return Proposal({}, {})
    start = time.perf_counter()
    got = batched(group, models, together, lambda r: together([r])[0])
    seconds = time.perf_counter() - start
    for r in routed if len(got) == len(group) else [r for r in routed if r.request_id in got]:
        r.stats.router_times.append(seconds)  # the decision with the draw beside it: one pass, one sync
    tokens = {request_id: token for request_id, (token, _) in got.items()}
    scores = {request_id: score for request_id, (_, score) in got.items() if score is not None}
    return Proposal(tokens, scores)


def forced_levels(
    models: Sequence[Backend], live: list[Live], num_levels: int, stalls: Callable[[Live, int], bool]
) -> tuple[list[Live], dict[str, int]]:
    """Stage 1: (live, levels): the level of each request whose step's level is known before
    M_S runs (`forced_level`), and live without those dropped on the way (failed alone, or
    stalled by a long catch-up: `stalls`). Plain requests (the common case) skip the call:
    their level is never forced."""
    special = [r for r in live if r.degraded or r.finish_after_verify or r.router.forces_levels]
    if not special:
        return live, {}
    forced = each(special, models, lambda r: forced_level(r, num_levels))  # -1: M_S steps
    levels = {request_id: f for request_id, f in forced.items() if f >= 0}
    dropped = {
        r.request_id
        for r in special
        if r.request_id not in forced or (forced[r.request_id] > 0 and stalls(r, forced[r.request_id]))
    }
    return [r for r in live if r.request_id not in dropped and not r.done], levels


def forced_level(r: Live, num_levels: int) -> int:
    """Stage 1: the level of r's step if it is known before M_S runs, else -1."""
    if r.degraded:
        return -1
    if r.finish_after_verify:  # about to finish with unverified drafts: the largest model checks them
        return num_levels - 1
    if not r.router.forces_levels:
        return -1
    f = r.router.levels_before_small_step([r.drafts()], [r.thresholds], num_levels)
    return f[0] if f is not None else -1


def decide(
    group: list[Live], scores: dict[str, float], levels: dict[str, int], outcomes: dict, num_levels: int
) -> None:
    """Stage 4, on the host: level = how many of r's thresholds its score reaches (host
    floats, float64), into `levels` (level 0, M_S, is every request's without an entry). An
    oracle's outcome is kept only for a step that is the largest model's."""
    top = num_levels - 1
    for r in group:
        s = scores[r.request_id]
        outcome = outcomes.get(r.request_id)
        if outcome is not None and outcome.rolled_back:
            levels[r.request_id] = top  # verification already replaced the step's token
            continue
        thresholds = r.thresholds
        level = int(s >= thresholds[0]) if len(thresholds) == 1 else sum(s >= t for t in thresholds)
        if level:
            levels[r.request_id] = level
        if outcome is not None and level != top:
            del outcomes[r.request_id]  # the oracle looked, but the step is not the large model's


def _context(
    router: DecisionFunction, g: list[Live], logits: torch.Tensor, small: SmallOut, large: dict, coins
) -> StepContext:
    """The StepContext of router's rows g (logits: their M_S logits [b, V]; coins: their
    uniforms on the host, or None), on the logits' device."""
    dev = logits.device
    return StepContext(
        small_logits=logits,
        hidden=small.take([r.request_id for r in g])[1] if router.hidden_layer is not None else None,
        large_logits=torch.stack([large[r.request_id] for r in g]) if router.needs_large_logits else None,
        drafts=torch.tensor([r.drafts() for r in g]).to(dev, non_blocking=True)
        if router.reads_drafts
        else torch.zeros(len(g), dtype=torch.long, device=dev),
        uniforms=torch.from_numpy(coins).to(dev) if coins is not None else torch.zeros(len(g), device=dev),
    )


def small_for_degraded(models: list[Backend], live: list[Live], small: SmallOut, proposal: Proposal) -> SmallOut:
    """After the catch-ups: a request whose catch-up failed (degraded) and that skipped M_S
    this step takes M_S's token instead; small with its rows added (proposal gets the tokens)."""
    late = [
        r
        for r in live
        if r.degraded
        and r.failure is None
        and r.request_id not in small
        and r.request_id not in proposal.tokens  # a step that waited drew it then
        and not r.finish_after_verify
    ]
    if not late:
        return small
    small = small.merged(small_step(models, late))
    late = [r for r in late if r.request_id in small]
    proposal.tokens.update(propose(models, late, [], small, {}).tokens)
    return small
