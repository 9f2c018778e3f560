"""Batched catch-up on the large model's side (no Ray): many sessions, one forward.

Each catch-up call carries ALL pending ids of one session (a chunk) and the number of
positions the caller believes the session holds (`past`). Calls wait in a queue; a loop
takes every call that has arrived -- and, while they keep coming (no gap longer than
`batch_gap_s`, at most `batch_wait_s`), the rest of the caller's step (`group`) -- and
runs them as ONE `ModelRunner.extend` (ragged lengths are the
runner's business). Forwards and every session change run on one thread, in order, so
the event loop keeps accepting calls while a forward runs (continuous batching).

A call whose session is missing or shorter than `past` is answered `lost` (the caller
re-prefills elsewhere); a longer one is cropped to `past` (a rollback).

KV budget (runner.py, static_kv.py): a forward that would pass the budget evicts idle
sessions, least recently used first (their next call is answered `lost`: the caller
re-prefills). A NEW session (past 0, not a `refill` of a lost one) that does not fit
beside the forward's other sessions -- or finds no free static slot -- is answered
`refused` (the caller's request ends with a retriable 503); the forward's others go on.

Sessions are freed by their caller's close, by TTL, and by lease: a call names its
`owner` (a SmallModel replica), every call and every `renew(owner)` renews that owner's
lease, and `expire_leases` frees the sessions of owners silent for longer than the lease
(a router that died cannot close them). A closed session key is remembered (a tombstone), so a
late call that arrives after its close -- a call the caller gave up on -- cannot recreate
the session.
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from backoff_core.errors import KVCapacityError
from backoff_core.runners.dynamic import ModelRunner
from deployments.serving.catchup_wire import BatcherStats, CatchUpCall, CatchUpReply, ForwardRecord, ScoredRows


class CatchUpBatcher:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        batching: bool = True,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.02,
        batch_gap_s: float = 0.005,
        on_forward: Callable[[ForwardRecord], None] | None = None,
    ) -> None:
        self.runner = runner
        self.batching = batching
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.batch_gap_s = batch_gap_s
        self.on_forward = on_forward
        self.stats = BatcherStats()
        self._pending: collections.deque[tuple[CatchUpCall, asyncio.Future]] = collections.deque()
        self._arrived: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the replica's, once a call came
        self._unclosed: collections.deque[str] = collections.deque()  # close_soon before any call
        self._forward_thread = ThreadPoolExecutor(1, thread_name_prefix="catch-up")
        # calls of each recent caller step already taken into a forward (bounded)
        self._taken: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._leases: dict[str, float] = {}  # owner -> monotonic time of its last call or renewal
        self._owners: dict[str, str] = {}  # session key -> owner (forward thread only)
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()  # tombstones (bounded)
        # sessions an adopt_only call opened and found nothing cached for: its prefix track
        # (what the next calls store) is kept through the session's next call at past 0
        self._opened_empty: set[str] = set()

    # -- API (event loop) -------------------------------------------------------------------
    async def extend(self, call: CatchUpCall) -> CatchUpReply:
        if not call.ids:
            raise ValueError("a catch-up needs at least one pending id")
        if call.adopt_only and (call.past or not call.prefix_cache or call.scoring is not None):
            raise ValueError("an adopt_only call opens a session (past 0) with a prefix_cache length and no scoring")
        if call.scoring is not None:  # here, not in the shared forward: a bad call fails alone
            call.scoring.check(len(call.ids), self.runner.vocab_size)
        elif call.scored_only:
            raise ValueError("a scored_only call names rows to score")
        self._start()
        if call.owner:
            self.renew(call.owner)
        future = asyncio.get_running_loop().create_future()
        self._pending.append((call, future))
        self._arrived.set()
        return await future

    async def close(self, session_key: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self._forward_thread, self._close, session_key)

    def close_soon(self, session_key: str) -> None:
        """From any thread, a __del__ included: free a session after the forwards already
        queued. It takes no lock: a __del__ can run inside any ThreadPoolExecutor.submit of
        its thread (a collection there), which holds concurrent.futures' global lock, so a
        submit here would wait for itself forever. The event loop submits the close."""
        loop = self._loop
        if loop is None:  # no call yet: _start submits it
            self._unclosed.append(session_key)
            return
        try:
            loop.call_soon_threadsafe(self._submit_close, session_key)
        except RuntimeError:  # the loop is closed: the sessions go with the replica
            pass

    def _submit_close(self, session_key: str) -> None:
        try:
            self._forward_thread.submit(self._close, session_key)
        except RuntimeError:  # shut down: the sessions go with the replica
            pass

    def renew(self, owner: str) -> None:
        """The owner is alive: its sessions stay for another lease."""
        self._leases[owner] = time.monotonic()

    async def expire_leases(self, lease_s: float) -> list[str]:
        """Free the sessions of owners that neither called nor renewed for lease_s; their session keys."""
        cutoff = time.monotonic() - lease_s
        for owner in [o for o, t in self._leases.items() if t < cutoff]:
            del self._leases[owner]
        return await asyncio.get_running_loop().run_in_executor(self._forward_thread, self._free_orphans)

    def owners(self) -> dict[str, int]:
        """owner -> sessions held for it."""
        return dict(collections.Counter(self._owners.values()))

    async def expire(self, ttl_s: float) -> list[str]:
        """Free sessions idle for ttl_s; returns their session keys."""
        session_keys = self.runner.idle_sessions(ttl_s)
        for session_key in session_keys:
            await self.close(session_key)
        return session_keys

    def holds(self, session_key: str) -> bool:
        return self.runner.has(session_key)

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._forward_thread.shutdown(wait=False, cancel_futures=True)

    # -- the loop ---------------------------------------------------------------------------
    def _start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            while self._unclosed:
                self._submit_close(self._unclosed.popleft())
        if self._loop_task is None or self._loop_task.done():
            self._arrived = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_forever())

    async def _run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            try:
                replies = await loop.run_in_executor(self._forward_thread, self._forward, [c for c, _ in batch])
            except Exception as exc:  # a bad call fails its whole forward, never the loop
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), reply in zip(batch, replies):
                if not future.done():  # the caller may have gone (cancelled)
                    future.set_result(reply)

    async def _next_batch(self) -> list[tuple[CatchUpCall, asyncio.Future]]:
        while not self._pending:
            self._arrived.clear()
            await self._arrived.wait()
        if not self.batching:
            return [self._pending.popleft()]
        batch: list[tuple[CatchUpCall, asyncio.Future]] = []
        session_keys: set[str] = set()
        opened = time.monotonic()
        deadline = opened + self.batch_wait_s
        while True:
            self._take(batch, session_keys)
            remaining = deadline - time.monotonic()
            if len(batch) >= self.max_batch_size or remaining <= 0 or not self._incomplete(batch):
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), min(remaining, self.batch_gap_s))
            except asyncio.TimeoutError:  # a gap: the step's other calls went to other replicas
                break
        self._count_taken(batch)
        self.stats.waited_s += time.monotonic() - opened
        return batch

    def _take(self, batch: list, session_keys: set[str]) -> None:
        """Move queued calls into the batch; a second call of one session waits for the next."""
        later = []
        while self._pending and len(batch) < self.max_batch_size:
            call, future = self._pending.popleft()
            if call.session_key in session_keys:
                later.append((call, future))
            else:
                session_keys.add(call.session_key)
                batch.append((call, future))
        self._pending.extendleft(reversed(later))

    def _incomplete(self, batch: list[tuple[CatchUpCall, asyncio.Future]]) -> bool:
        """Whether some caller step in the batch still has calls on their way here."""
        seen: collections.Counter = collections.Counter(c.group for c, _ in batch if c.group)
        sizes = {c.group: c.group_size for c, _ in batch if c.group}
        return any(seen[g] + self._taken.get(g, 0) < sizes[g] for g in seen)

    def _count_taken(self, batch: list[tuple[CatchUpCall, asyncio.Future]]) -> None:
        for call, _ in batch:
            if call.group:
                self._taken[call.group] = self._taken.get(call.group, 0) + 1
                self._taken.move_to_end(call.group)
        while len(self._taken) > 1024:
            self._taken.popitem(last=False)

    # -- the forward thread -----------------------------------------------------------------
    def _close(self, session_key: str) -> None:
        # the records first, the runner's session last: whoever sees a session gone (info(),
        # from the event loop's thread) sees its records gone with it
        self._owners.pop(session_key, None)
        self._opened_empty.discard(session_key)
        self._closed[session_key] = None
        while len(self._closed) > 65536:
            self._closed.popitem(last=False)
        self.runner.close(session_key)

    def _free_orphans(self) -> list[str]:
        session_keys = [session_key for session_key, owner in self._owners.items() if owner not in self._leases]
        for session_key in session_keys:
            self.stats.orphans_freed += 1  # counted before it goes, as _close's records
            self._close(session_key)
        return session_keys

    def _forward(self, calls: list[CatchUpCall]) -> list[CatchUpReply]:
        replies: list[CatchUpReply | None] = [None] * len(calls)
        ready = []
        for i, call in enumerate(calls):
            problem = self._prepare(call)
            if problem is None and call.adopt_only:
                adopted = self._adopt(call)
                if not adopted:
                    self._opened_empty.add(call.session_key)
                replies[i] = CatchUpReply(np.zeros((0, 0), dtype=np.float32), adopted=adopted)
                continue
            if problem is None:
                ready.append(i)
                continue
            replies[i] = problem
            if problem.refused:
                self.stats.refused += 1
            else:
                self.stats.lost += 1
        ready = self._fit(calls, ready, replies)
        self.stats.calls += len(calls)
        if ready:
            start = time.perf_counter()
            last_only = all(calls[i].last_only for i in ready)  # one forward: every row if any call wants them
            evictions = getattr(self.runner, "evictions", 0)
            items = [(calls[i].session_key, list(calls[i].ids[self._adopt(calls[i]) :])) for i in ready]
            scoring = [calls[i].scoring for i in ready]
            if any(sc is not None for sc in scoring):  # prompt logprobs: some rows scored here
                exts = self.runner.extend(items, last_only=last_only, scoring=scoring)
            else:
                exts = self.runner.extend(items, last_only=last_only)
            if getattr(self.runner, "evictions", 0) != evictions:  # idle sessions made room: forget their owners
                for session_key in [k for k in self._owners if not self.runner.has(k)]:
                    del self._owners[session_key]
            seconds = time.perf_counter() - start
            self.stats.forward_s += seconds
            for i, ext in zip(ready, exts):
                logits = (
                    ext.logits[:0] if calls[i].scored_only else ext.logits[-1:] if calls[i].last_only else ext.logits
                )
                scored = ScoredRows.of(ext.scored) if ext.scored is not None else None
                replies[i] = CatchUpReply(logits.cpu().numpy(), scored=scored)
            self.stats.forward_passes += 1
            self.stats.batch_sizes[len(ready)] += 1
            if self.on_forward is not None:
                self.on_forward(ForwardRecord(len(ready), tuple(len(ids) for _, ids in items), seconds))
        return replies

    def _adopt(self, call: CatchUpCall) -> int:
        """Positions of a fresh session loaded from the runner's prefix cache (its reply is the
        last row only, so the forward may skip them); 0 for any other call."""
        adopt = getattr(self.runner, "adopt_prefix", None)
        if adopt is None or call.past or not call.prefix_cache or not call.last_only or call.scoring is not None:
            return 0
        return adopt(call.session_key, call.ids, call.prefix_cache)

    def _prepare(self, call: CatchUpCall) -> CatchUpReply | None:
        """Bring the session to `past` positions; None when ready, else the reply (lost or refused)."""
        runner, session_key = self.runner, call.session_key
        if call.past == 0:
            if session_key in self._closed:
                return CatchUpReply(None, f"session {session_key!r} was closed (a late call)")
            if session_key in self._opened_empty:
                self._opened_empty.discard(session_key)
                if not call.adopt_only and runner.has(session_key) and runner.length(session_key) == 0:
                    return None  # opened by its adopt_only call: fresh, and its prefix track kept
            runner.close(session_key)  # a fresh epoch starts from nothing
            try:
                runner.open(session_key, refill=call.refill)
            except KVCapacityError as exc:  # static storage: no free slot
                return CatchUpReply(None, refused=str(exc))
            if call.owner:
                self._owners[session_key] = call.owner
            return None
        if not runner.has(session_key):
            return CatchUpReply(None, f"{runner.name} holds no session {session_key!r}")
        held = runner.length(session_key)
        if held < call.past:
            return CatchUpReply(
                None, f"{runner.name} holds {held} positions of {session_key!r}, the caller expects {call.past}"
            )
        if held > call.past:
            runner.crop(session_key, call.past)  # the caller rolled back
        return None

    def _fit(self, calls: list[CatchUpCall], ready: list[int], replies: list) -> list[int]:
        """The ready calls that fit the KV room: held sessions always, and refills on
        per-session caches (which may grow past the budget); a new session (on static slots, a
        refill too: it needs a slot as much) only while it fits beside them and the ones taken
        before it (in order)."""
        runner = self.runner
        if not hasattr(runner, "kv_fits") or getattr(runner, "kv_budget_tokens", 0) is None:
            return ready
        dynamic = not hasattr(runner, "kv")  # ModelRunner, or one over tensor-parallel ranks (no static kv)
        budget = runner.kv_budget_tokens if dynamic else runner.kv.budget

        def held(c: CatchUpCall) -> bool:
            return c.past > 0 or (c.refill and dynamic)

        taken = [i for i in ready if held(calls[i])]
        for i in ready:
            if held(calls[i]):
                continue
            if runner.kv_fits([(calls[j].session_key, len(calls[j].ids)) for j in (*taken, i)]):
                taken.append(i)
                continue
            runner.close(calls[i].session_key)
            self._owners.pop(calls[i].session_key, None)
            self.stats.refused += 1
            replies[i] = CatchUpReply(
                None,
                refused=(
                    f"{runner.name}: no KV room for a new session ({len(calls[i].ids)} positions) beside the "
                    f"live ones (kv_budget_tokens={budget}); retry when a request ends"
                ),
            )
        return sorted(taken)
