"""StaticRunner's sessions and the slots of its storage they hold (static.py).

A session owns one slot of StaticKV for its whole life: M_S's from its open, M_L's
(`evict_idle`) from its first extend. When an extend needs slots and none is free, the least
recently used sessions outside that extend give theirs up (evicted: their requests re-prefill
at their next catch-up); if even that leaves too few, the extend is refused, changing nothing
(KVCapacityError, retriable).
"""

from __future__ import annotations

from dataclasses import dataclass

from backoff_core.errors import KVCapacityError
from backoff_core.runners.sessions import Session, SessionTable
from backoff_core.runners.static_kv import StaticKV


@dataclass(kw_only=True)
class SlotSession(Session):
    slot: int | None  # its row of the static storage; None until its first extend (evict_idle)


class SlotSessions(SessionTable[SlotSession]):
    """The session table over slots (a mixin: `kv`, `evict_idle` and `evictions` are the
    runner's)."""

    kv: StaticKV
    evict_idle: bool
    evictions: int

    def _new_session(self, request_id: str, refill: bool) -> SlotSession:
        # refill changes nothing here: a session needs a slot either way
        return SlotSession(slot=None if self.evict_idle else self.kv.take(), refill=refill)

    def _release(self, session: SlotSession) -> None:
        if session.slot is not None:
            self.kv.give_back(session.slot)

    def _room(self, request_id: str, s: SlotSession, n: int) -> bool:
        """Whether s can take n more positions now (prefix_cache.PrefixCaching's question)."""
        try:
            self._reserve([(request_id, [0] * n)], [s])
        except KVCapacityError:
            return False
        return True

    def kv_fits(self, items: list[tuple[str, int]]) -> bool:
        """Whether these sessions, each grown by its count of new positions, can extend
        together: each within a slot, and a slot for each that has none (every other session
        evicted if need be)."""
        with self._lock:
            sessions = [self._get(request_id) for request_id, _ in items]
            if any(s.length + n > self.kv.capacity for s, (_, n) in zip(sessions, items)):
                return False
            return sum(s.slot is None for s in sessions) <= self._obtainable_slots({r for r, _ in items})

    def _obtainable_slots(self, extending: set[str]) -> int:
        held = sum(s.slot is not None for r, s in self._sessions.items() if r not in extending)
        return self.kv.free_slots + (held if self.evict_idle else 0)

    def _reserve(self, items: list[tuple[str, list[int]]], sessions: list[SlotSession]) -> None:
        """A slot for every session of this extend (under the lock): evict the least recently
        used sessions outside it while none is free; refuse, changing nothing, if even that
        leaves too few."""
        needing = [s for s in sessions if s.slot is None]
        if len(needing) <= self.kv.free_slots:  # the common case: nothing to evict
            for s in needing:
                s.slot = self.kv.take()
            return
        extending = {request_id for request_id, _ in items}
        if len(needing) > self._obtainable_slots(extending):
            raise KVCapacityError(
                f"{self.name}: no KV slot for a new session: the sessions of this extend need "
                f"{sum(s.slot is not None for s in sessions) + len(needing)} of {self.kv.slots} slots "
                f"(kv_budget_tokens={self.kv.budget}); retry when a request ends"
            )
        idle = sorted((s.last_used, r) for r, s in self._sessions.items() if r not in extending and s.slot is not None)
        for _, request_id in idle[: max(0, len(needing) - self.kv.free_slots)]:
            self._release(self._sessions.pop(request_id))
            self.evictions += 1
        for s in needing:
            s.slot = self.kv.take()
