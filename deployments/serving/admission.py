"""Admission of requests into a SmallModel replica: bounded, never an unbounded queue (no Ray).

Every live request is in every batched step of the replica, so each one admitted makes all
the others slower. The gate lets `max_live` requests into the step loop, lets `max_waiting`
more wait (first come, first served) for one of them to finish, and refuses the rest at
once: the caller gets an `Overloaded` item and the client a 503 + Retry-After (gRPC
RESOURCE_EXHAUSTED). A wait is bounded too: at most max_waiting requests are ahead, and
every live request ends (max_tokens, the context window).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class Overloaded:
    """The replica is full: refused before admission, retry after `retry_after_s`."""

    message: str
    retry_after_s: float


class AdmissionGate:
    """Counts slots on the replica's event loop (one thread: no lock)."""

    def __init__(self, max_live: int, max_waiting: int) -> None:
        self.max_live = max_live
        self.max_waiting = max_waiting
        self.live = 0  # slots held, including those just handed to a waiter
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in self._waiters)

    async def enter(self) -> bool:
        """True once the caller holds a slot (call `leave()` after); False at once when the
        replica is full. Cancelled while waiting: nothing held."""
        if self.live < self.max_live and not self.waiting:
            self.live += 1
            return True
        if self.waiting >= self.max_waiting:
            return False
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # the slot arrived as the caller left
                self.leave()
            raise
        finally:
            if turn in self._waiters:
                self._waiters.remove(turn)
        return True

    def leave(self) -> None:
        """Free a slot: the first waiter takes it over, else it is returned."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes on: `live` is unchanged
                return
        self.live -= 1
        assert self.live >= 0, "leave() without enter()"
