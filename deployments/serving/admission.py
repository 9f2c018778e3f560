"""Admission of requests into a SmallModel replica: a bounded FIFO queue in front of the live
slots (no Ray, no torch: the Ingress reads `Overloaded`).

Every live request is in every batched step of the replica, so each one admitted makes all
the others slower. The gate lets `max_live` requests into the step loop and queues up to
`max_waiting` more, served first come first served as live ones finish: under load a
request waits (its latency grows) instead of being refused, as vLLM and OpenAI do. Only past
the queue is a request refused at once, and a waiter whose turn has not come within
`timeout_s` is refused then: the caller gets an `Overloaded` item and the client a 503 +
Retry-After (gRPC RESOURCE_EXHAUSTED), code `overloaded` or `queue_timeout`. A waiter that
goes away (disconnect, cancel) holds nothing.

The live slots are `max_live_requests`, or fewer where M_S's static KV holds fewer sessions
(each live request owns a slot: one more would be refused by M_S as `kv_capacity`); the
queue's default depth (`max_waiting_requests: auto`) is QUEUE_PER_LIVE x the live slots.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

# `max_waiting_requests: auto` queues this many waiters per live slot: a waiter at the back
# starts after about three request lifetimes (at the defaults 48 live + 144 waiting, so a load
# tool at concurrency 128 against one replica waits instead of being refused)
QUEUE_PER_LIVE = 3


@dataclass(frozen=True)
class Overloaded:
    """Refused before admission, retry after `retry_after_s`: the queue was full
    (code `overloaded`) or the request waited `timeout_s` in it (`queue_timeout`)."""

    message: str
    retry_after_s: float
    code: str = "overloaded"


def live_slots(max_live: int, kv_sessions: int | None) -> int:
    """Requests the step loop takes at once: `max_live`, or the sessions M_S's KV holds where
    it holds fewer (static KV: budget // max_len slots; None: per-session caches, no slots)."""
    return max_live if kv_sessions is None else max(1, min(max_live, kv_sessions))


def queue_depth(max_waiting: int | str, live: int) -> int:
    """Waiters the queue holds: the configured number, or QUEUE_PER_LIVE x live for `auto`."""
    return QUEUE_PER_LIVE * live if max_waiting == "auto" else int(max_waiting)


class AdmissionGate:
    """Counts slots on the replica's event loop (one thread: no lock)."""

    def __init__(
        self, max_live: int, max_waiting: int, timeout_s: float | None = None, retry_after_s: float = 1.0
    ) -> None:
        self.max_live, self.max_waiting = max_live, max_waiting
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.live = 0  # slots held, including those just handed to a waiter
        self.refused = 0  # arrivals that met a full queue
        self.timed_out = 0  # waiters refused after timeout_s
        self._waiters: collections.deque[asyncio.Future] = collections.deque()  # oldest first

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in self._waiters)

    async def enter(self) -> Overloaded | None:
        """None once the caller holds a slot (call `leave()` after), in arrival order; an
        Overloaded at once when the queue is full, or after timeout_s in it. Cancelled while
        waiting: nothing held."""
        if self.live < self.max_live and not self.waiting:
            self.live += 1
            return None
        if self.waiting >= self.max_waiting:
            self.refused += 1
            return Overloaded(
                f"the server is at capacity ({self.max_live} live and {self.max_waiting} waiting requests "
                "per replica); retry later",
                self.retry_after_s,
            )
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            async with asyncio.timeout(self.timeout_s):
                await turn
        except TimeoutError:
            if turn.done() and not turn.cancelled():  # the slot arrived as the wait ran out: keep it
                return None
            self.timed_out += 1
            return Overloaded(
                f"the request waited {self.timeout_s:g} s in the queue for one of the {self.max_live} live "
                "slots of a replica (admission.queue_timeout_s); retry later",
                self.retry_after_s,
                "queue_timeout",
            )
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # the slot arrived as the caller left
                self.leave()
            raise
        finally:
            if turn in self._waiters:
                self._waiters.remove(turn)
        return None

    def leave(self) -> None:
        """Free a slot: the first waiter takes it over, else it is returned."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes on: `live` is unchanged
                return
        self.live -= 1
        assert self.live >= 0, "leave() without enter()"
