"""Batched catch-ups (docs/batched-catch-ups.md): a request routed to a larger model may
wait, while the others step, for its catch-up to run in one forward with others'.

A waiting request does not step: its step's level, M_S's token and the router's score are
kept (`Live.waiting`) and put back into the proposal of the step that catches it up. The
waits at a level end, for all of them, in the first step where:
  - a request of the level's group may not wait (`may_wait`): its forward runs anyway, so
    all ride along;
  - the oldest would pass `wait_ms` by waiting one more step (taken to last as long as the
    last one), so where a step takes longer than `wait_ms` nothing waits;
  - `max_share` of the live requests or more would wait (default half: M_S would step a
    half-empty batch; a lone request never waits).
Nothing else changes: every draw is a pure function of (seed, position), so the tokens are
those of catch-ups run at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from backoff_core.engine.propose import Decided, Proposal
from backoff_core.engine.state import Live, Waiting

# the share of the live requests that ends the waits (hold.split): the default half
MAX_SHARE = 0.5


class CatchUpHold:
    def __init__(self, wait_ms: float, clock: Callable[[], float], collect_kl: bool) -> None:
        self.wait_ms = wait_ms  # 0: every catch-up runs in the step that routes it
        self.max_share = MAX_SHARE  # the waits end where this share of the live requests would wait
        self.clock = clock  # read once a step (tick), while wait_ms is set
        self.collect_kl = collect_kl
        self.now = self.step_s = 0.0  # this step's start, and the time since the last one's

    def tick(self) -> None:
        """At the start of a step."""
        if self.wait_ms:
            now = self.clock()
            self.step_s, self.now = now - self.now, now

    def may_wait(self, r: Live) -> bool:
        """A plain routed step only: verification reads its drafts in the catch-up's step; an
        oracle or forced level has its model run anyway; the KL record reads M_S's logits of
        the step at its commit."""
        return not (
            r.verifies
            or r.degraded
            or r.finish_after_verify
            or r.router.needs_large_logits
            or r.router.forces_levels
            or self.collect_kl
        )

    def holders(self, live: list[Live], levels: dict[str, int], outcomes: dict) -> set[str]:
        """The requests that would wait after this step if no catch-up ran (routed to a
        larger level, or waiting there, and allowed to wait)."""
        return {
            r.request_id
            for r in live
            if levels.get(r.request_id, 0) > 0 and r.request_id not in outcomes and self.may_wait(r)
        }

    @staticmethod
    def take_waiting(live: list[Live], levels: dict[str, int]) -> list[Live]:
        """Stage 5's start: the waiting ones of live, their levels put back into levels."""
        waiting = [r for r in live if r.waiting is not None]
        for r in waiting:
            levels[r.request_id] = r.waiting.level
        return waiting

    def groups(
        self, live: list[Live], step: Decided, waiting: list[Live], num_levels: int
    ) -> Iterator[tuple[int, list[Live]]]:
        """Stage 5's catch-ups, level by level: (level, the requests routed there this step
        or waiting there, none with an outcome yet, degraded or failed, that catch up now).
        Each group is made once the catch-ups of the levels below have their outcomes."""
        levels, outcomes = step.levels, step.outcomes
        holders = self.holders(live, levels, outcomes) if levels and (self.wait_ms or waiting) else set()
        for level in range(1, num_levels) if levels else ():
            group = [
                r
                for r in live
                if levels.get(r.request_id) == level
                and r.request_id not in outcomes
                and not r.degraded
                and r.failure is None
            ]
            yield level, self.split(level, group, holders, len(live), step.proposal) if holders and group else group

    def split(self, level: int, group: list[Live], holders: set[str], live: int, proposal: Proposal) -> list[Live]:
        """Of group (routed to `level` this step or waiting there; none in outcomes), those
        that catch up in this step: all of them, or none (the others start or go on waiting)."""
        oldest = min((r.waiting.since for r in group if r.waiting is not None), default=self.now)
        if (
            self.wait_ms  # 0 (set between steps): the waiting ones catch up now
            and len(holders) < self.max_share * live
            and self.now - oldest + self.step_s <= self.wait_ms / 1e3
            and all(r.request_id in holders for r in group)
        ):
            self.wait(level, group, proposal)
            return []
        self.resume(group, proposal)
        return group

    def wait(self, level: int, group: list[Live], proposal: Proposal) -> None:
        """Those of group not waiting yet keep this step (M_S's token, the router's score)."""
        for r in group:
            if r.waiting is None:
                r.waiting = Waiting(level, proposal.tokens[r.request_id], proposal.scores.get(r.request_id), self.now)

    @staticmethod
    def resume(group: list[Live], proposal: Proposal) -> None:
        """The waiting ones of group take up their step, as if they had caught up when routed."""
        for r in group:
            if r.waiting is not None:
                proposal.tokens[r.request_id] = r.waiting.token
                if r.waiting.score is not None:
                    proposal.scores[r.request_id] = r.waiting.score
                r.waiting = None
