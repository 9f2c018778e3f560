"""A Backend (backoff_core.engine.backends) whose model lives in remote replicas (no Ray here).

The step loop calls `extend` with the pending ids of many requests; this proxy sends ONE
call per session carrying all of its pending ids (a chunk), all calls of a step at once,
tagged with the step so the replica's batcher can merge them into one forward; a reply
carries the logits after the last id only, unless the engine asks for every row. Session
keys are `<request id>#<epoch>`: a re-prefill opens a new epoch, so a replica that still
holds an old copy can never be extended by mistake. `open` and `crop` cost no round trip:
the next call says how many positions it expects (`past`) and the replica creates or
crops. A session the replicas no longer hold (replica lost, TTL) raises SessionLost and
the engine re-prefills it from the token ids it keeps.

A step's calls share one deadline, `timeout_s` (the live `large_timeout_s`): sessions
without a reply by then -- M_L too slow, or no replica to create a session on -- raise
LargeUnavailable with the replies that did come, and the engine degrades (or fails) just
those requests. Their sessions are closed like any other (a late call meets a tombstone).
Every call names `owner`, the SmallModel replica whose lease keeps its sessions alive.

KV budget: a replica with no KV room for a NEW session answers `refused` (its others go
on); this proxy raises KVCapacityError carrying the replies that came, and that request
ends with a retriable 503. The re-prefill of a session that was lost (evicted to make
room, or its replica died) is flagged `refill`: its request is live, so it is never refused.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from backoff_core.errors import KVCapacityError, LargeUnavailable, SessionLost
from backoff_core.runners.dynamic import Extension
from backoff_core.runners.scoring import Scoring, per_item
from backoff_core.runners.sessions import Session, SessionTable
from deployments.serving.catchup_wire import CatchUpCall, CatchUpReply

log = logging.getLogger(__name__)


class Pending(Protocol):
    def result(self, timeout_s: float | None = None) -> CatchUpReply: ...


class LargeEndpoint(Protocol):
    """How RemoteLarge reaches a large model's replicas (the Ray adapter is in small.py)."""

    transport_errors: tuple[type[BaseException], ...]  # what a lost replica raises

    def extend(self, call: CatchUpCall) -> Pending: ...

    def close(self, session_key: str) -> None: ...


@dataclass(kw_only=True)
class _RemoteSession(Session):
    """This proxy's record of a session the replicas hold (`length`: as far as it knows)."""

    session_key: str  # `<request id>#<epoch>`
    sent: bool = False  # a call went out: a replica may hold it (even one that got no reply)
    prefix_cache: int = 0  # adopt_prefix's cacheable length, sent with the session's first call


_epochs = itertools.count()

# full logits rows ([k, V] float32) in one call at most this large: an oracle scoring a prompt
# sends M_S's logits of max_logit_rows rows a call (Scoring.against, engine/prompt.py) and is
# answered their KL, target and top-n; half of Serve's default 4 MiB message cap, so it holds
# where a node's cap was not raised
LOGIT_ROWS_BYTES = 2 << 20


class RemoteLarge(SessionTable[_RemoteSession]):
    def __init__(
        self,
        endpoint: LargeEndpoint,
        name: str,
        vocab_size: int,
        *,
        timeout_s: float = 30.0,
        create_retries: int = 5,
        owner: str = "",
    ) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.name = name
        self.vocab_size = vocab_size
        self.max_logit_rows = max(1, LOGIT_ROWS_BYTES // (4 * vocab_size))  # 10 at V = 49152
        self.timeout_s = timeout_s  # replaced by reconfigure; read once per step
        self.owner = owner
        self.create_retries = create_retries
        self.lost_sessions = 0
        self.calls = 0
        self.wait_s = 0.0  # time the step loop spent waiting for catch-up replies
        self._uid = uuid.uuid4().hex[:8]
        self._steps = itertools.count()
        self._lost: collections.OrderedDict[str, None] = collections.OrderedDict()  # recently lost (bounded)

    # -- sessions (sessions.SessionTable; a crop moves the length: the next call's `past`
    # tells the replica) --------------------------------------------------------------------
    def _new_session(self, request_id: str, refill: bool) -> _RemoteSession:
        refill = refill or self._lost.pop(request_id, 0) is None
        return _RemoteSession(session_key=f"{request_id}#{next(_epochs)}", refill=refill)

    def _release(self, session: _RemoteSession) -> None:
        if session.sent:
            try:
                self.endpoint.close(session.session_key)  # fire and forget; TTL frees what this misses
            except Exception:  # noqa: BLE001 - a lost replica has nothing left to free
                log.debug("close of %s failed", session.session_key, exc_info=True)

    def adopt_prefix(self, request_id: str, ids, cacheable: int | None = None) -> int:
        """The replica's prefix cache serves the session's first call (CatchUpCall.prefix_cache):
        it skips what it finds cached and answers the last row as usual, so every id is still
        sent and 0 positions are adopted here."""
        with self._lock:
            s = self._get(request_id)
            if s.length == 0:
                s.prefix_cache = len(ids) if cacheable is None else cacheable
        return 0

    def load_prefix(self, request_id: str, ids, cacheable: int | None = None) -> int:
        """adopt_prefix, answered now (chunked prefill feeds a prompt from what is cached, so it
        must know before its first chunk): one adopt_only call, in which the replica opens the
        session and loads its longest cached prefix of ids[:cacheable]; the positions it holds.
        Any failure is 0 here: the session's first chunk then meets it where failures are handled."""
        with self._lock:
            s = self._get(request_id)
            if s.length:
                raise ValueError(f"{self.name}: load_prefix needs a fresh session, {request_id!r} holds {s.length}")
            s.prefix_cache = len(ids) if cacheable is None else cacheable
            if not s.prefix_cache or len(ids) < 2:
                return 0
            call = CatchUpCall(
                s.session_key,
                0,
                tuple(ids),
                owner=self.owner,
                last_only=True,
                refill=s.refill,
                prefix_cache=s.prefix_cache,
                adopt_only=True,
            )
            s.sent = True
        try:
            reply = self._receive(call, self.endpoint.extend(call), time.monotonic() + self.timeout_s)
        except LargeUnavailable:
            return 0
        if reply.logits is None or reply.refused:
            return 0
        with self._lock:
            s.length, s.prefix_cache = reply.adopted, 0  # the replica holds the session: no second lookup
        return reply.adopted

    def extend(
        self,
        items: list[tuple[str, list[int]]],
        hidden_layer: int | None = None,
        last_only: bool = False,
        scoring: list[Scoring | None] | None = None,
    ) -> list[Extension]:
        """scoring: per item, rows the replica scores (runners/scoring.py) and answers as a
        few numbers a row instead of full logits (prompt logprobs); with last_only, a scored
        item's Extension has no logits rows ([0, V]: prompt scoring reads its scored rows alone)."""
        if hidden_layer is not None:
            raise ValueError(f"{self.name}: a remote model returns no hidden states")
        scoring = per_item(self.name, items, scoring, self.vocab_size)
        group = f"{self._uid}-{next(self._steps)}"
        calls = [
            CatchUpCall(
                self._get(request_id).session_key,
                self._get(request_id).length,
                tuple(ids),
                group,
                len(items),
                self.owner,
                last_only,
                refill=self._get(request_id).refill,
                scoring=sc,
                prefix_cache=self._get(request_id).prefix_cache if self._get(request_id).length == 0 else 0,
                scored_only=sc is not None and last_only,  # prompt scoring reads the scored rows alone
            )
            for (request_id, ids), sc in zip(items, scoring)
        ]
        start, deadline = time.perf_counter(), time.monotonic() + self.timeout_s
        for request_id, _ in items:
            self._sessions[request_id].sent = True
        pending = [self.endpoint.extend(call) for call in calls]  # all in flight together
        out, lost, failed, refused = {}, [], [], []
        # the engine re-prefills the whole group after a loss: these are live, never refused then
        live = [
            request_id
            for request_id, _ in items
            if self._sessions[request_id].length or self._sessions[request_id].refill
        ]
        for (request_id, ids), call, p in zip(items, calls, pending):
            try:
                reply = self._receive(call, p, deadline)
            except LargeUnavailable as exc:
                failed.append(str(exc))
                continue
            if reply.refused:
                refused.append(reply.refused)
                continue
            if reply.logits is None:
                lost.append(request_id)
                continue
            self._sessions[request_id].length += len(ids)
            scored = reply.scored.scored() if reply.scored is not None else None
            if scored is None and call.scoring is not None:
                raise RuntimeError(f"{self.name}: the replica answered {call.session_key} without its scored rows")
            out[request_id] = Extension(torch.from_numpy(np.array(reply.logits, dtype=np.float32)), None, scored)
        self.calls += len(calls)
        self.wait_s += time.perf_counter() - start
        if failed:
            log.warning("%s: %d of %d catch-ups failed (%s)", self.name, len(failed), len(calls), failed[0])
            raise LargeUnavailable(failed[0], out)
        if lost:
            self.lost_sessions += len(lost)
            for request_id in (*lost, *live):
                self._lost[request_id] = None
            while len(self._lost) > 4096:
                self._lost.popitem(last=False)
            raise SessionLost(f"{self.name}: the replicas lost sessions {lost}; re-prefill them")
        if refused:
            raise KVCapacityError(refused[0], out)
        return list(out.values())

    def _receive(self, call: CatchUpCall, pending: Pending, deadline: float) -> CatchUpReply:
        for attempt in range(self.create_retries + 1):
            try:
                return pending.result(timeout_s=max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                raise LargeUnavailable(f"{self.name}: no reply within {self.timeout_s:g} s") from None
            except self.endpoint.transport_errors as exc:
                if call.past > 0:
                    log.warning("%s: replica of %s lost (%s)", self.name, call.session_key, type(exc).__name__)
                    return CatchUpReply(None, f"replica lost: {type(exc).__name__}")
                pause = 0.1 * 2**attempt
                if attempt == self.create_retries or time.monotonic() + pause > deadline:
                    raise LargeUnavailable(f"{self.name}: no replica answers ({type(exc).__name__})") from exc
                # nothing to lose yet: a fresh session just goes to a live replica
                time.sleep(pause)
                pending = self.endpoint.extend(call)
        raise AssertionError("unreachable")
