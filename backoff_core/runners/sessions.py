"""The session table every runner keeps: one record per request id.

A session is one request's KV cache on one model. ModelRunner (dynamic.py) records a
DynamicCache per session, StaticRunner (static.py) a slot of its preallocated storage, and
RemoteLarge (deployments/serving/remote.py) what it knows of a session that remote replicas
hold. All three track the positions held, when the session was last used (idle ones are
swept or evicted first) and whether it rebuilds a lost one (`refill`: its request is live,
so the KV budget never refuses it); a subclass says how a record is made and freed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar


class SessionError(KeyError):
    """A request id this runner holds no session for (never opened, closed or expired)."""


@dataclass
class Session:
    length: int = 0  # positions held
    last_used: float = field(default_factory=time.monotonic)
    refill: bool = False  # rebuilds a session this or another runner lost (its request is live)
    adopted: int = 0  # positions loaded from the prefix cache at its start (prefix_cache.py)
    prefix: Any = None  # prefix_cache.PrefixTrack while its extends store prompt blocks


S = TypeVar("S", bound=Session)


class SessionTable(Generic[S]):
    """Request id -> session record, guarded by `_lock` (an RLock the runner's forward holds too)."""

    name: str

    def __init__(self) -> None:
        self._sessions: dict[str, S] = {}
        self._lock = threading.RLock()

    def _new_session(self, request_id: str, refill: bool) -> S:
        raise NotImplementedError

    def _release(self, session: S) -> None:
        """Free what a closed session held (a slot, a remote copy); nothing by default."""

    def _crop(self, session: S, length: int) -> None:
        """Forget the positions from `length` on where they are stored; nothing by default."""

    def open(self, request_id: str, refill: bool = False) -> None:
        """refill: the session rebuilds one this or another runner lost (its request is live)."""
        with self._lock:
            if request_id in self._sessions:
                raise ValueError(f"{self.name}: session {request_id!r} is already open")
            self._sessions[request_id] = self._new_session(request_id, refill)

    def close(self, request_id: str) -> None:
        with self._lock:
            session = self._sessions.pop(request_id, None)
            if session is not None:
                self._release(session)

    def crop(self, request_id: str, length: int) -> None:
        """Forget every position from `length` on (rollback)."""
        with self._lock:
            session = self._get(request_id)
            if not 0 <= length <= session.length:
                raise ValueError(f"{self.name}: cannot crop {session.length} positions to {length}")
            self._crop(session, length)
            session.length = length

    def has(self, request_id: str) -> bool:
        return request_id in self._sessions

    def length(self, request_id: str) -> int:
        return self._get(request_id).length

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def idle_sessions(self, older_than_s: float) -> list[str]:
        cutoff = time.monotonic() - older_than_s
        with self._lock:
            return [request_id for request_id, s in self._sessions.items() if s.last_used < cutoff]

    def _extending(self, items: list[tuple[str, list[int]]]) -> list[S]:
        """The sessions of an extend's (request id, new ids) items, each named once with at
        least one new id. Called under the lock."""
        if any(len(ids) == 0 for _, ids in items):
            raise ValueError(f"{self.name}: extend needs at least one token per session")
        if len({request_id for request_id, _ in items}) != len(items):
            raise ValueError(f"{self.name}: a session appears twice in one extend")
        return [self._get(request_id) for request_id, _ in items]

    def _get(self, request_id: str) -> S:
        try:
            return self._sessions[request_id]
        except KeyError:
            raise SessionError(f"{self.name}: no session {request_id!r}") from None
