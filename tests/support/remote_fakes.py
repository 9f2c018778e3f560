"""Fakes for the Ray-free serving parts (deployments/serving): a replica's event loop on a
thread (`LoopThread`), and the transport RemoteLarge calls (`FakeEndpoint`: LargeModel
replicas as catch-up batchers on that loop, routed by a hash of the session key as Serve's
session affinity does, replicas that die included). No Ray: tests/support/serve_fakes.py
has the stand-ins that need it.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.dynamic import ModelRunner
from deployments.serving.batcher import CatchUpBatcher
from deployments.serving.catchup_wire import CatchUpCall, CatchUpReply
from deployments.serving.remote import RemoteLarge


class LoopThread:
    """An asyncio loop on a thread: plays a replica's event loop for callers on other threads."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        async def cancel_all():  # batchers' and sweepers' tasks, so nothing is left pending
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class Dead(Exception):
    """What calling a killed replica raises (Ray's RayActorError in the real endpoint)."""


class FakeEndpoint:
    """Replicas = batchers on one event loop; calls routed by a hash of the session key."""

    transport_errors = (Dead,)

    def __init__(self, large, loop_thread: LoopThread, replicas: int = 2) -> None:
        self.large, self.lt = large, loop_thread
        self.replicas = [CatchUpBatcher(ModelRunner(large, f"r{i}")) for i in range(replicas)]
        self.dead: set[int] = set()  # killed: calls to them raise Dead
        self.noticed: set[int] = set()  # the router has learnt they are gone
        self.calls: list[CatchUpCall] = []
        self.replies: list[tuple[CatchUpCall, CatchUpReply]] = []  # every answered call, in order

    def route(self, key: str) -> int:
        alive = [i for i in range(len(self.replicas)) if i not in self.noticed]
        return max(alive, key=lambda i: hashlib.sha1(f"{key}{i}".encode()).digest())

    def extend(self, call: CatchUpCall):
        self.calls.append(call)
        target = self.route(call.session_key)
        future = asyncio.run_coroutine_threadsafe(self.replicas[target].extend(call), self.lt.loop)
        fake = self

        class Pending:
            def result(self, timeout_s=None) -> CatchUpReply:
                reply = future.result(timeout_s)
                if target in fake.dead:
                    fake.noticed.add(target)
                    raise Dead(f"replica {target} died")
                fake.replies.append((call, reply))
                return reply

        return Pending()

    def close(self, key: str) -> None:
        if self.route(key) in self.dead:
            raise Dead("gone")
        asyncio.run_coroutine_threadsafe(self.replicas[self.route(key)].close(key), self.lt.loop).result(10)

    def holder(self) -> int:
        return next(i for i, b in enumerate(self.replicas) if b.runner.request_ids())


def remote_engine(pair, tokenizer, endpoint) -> tuple[BackoffEngine, RemoteLarge]:
    small, large = pair
    remote = RemoteLarge(endpoint, "large", ModelRunner(large).vocab_size)
    return BackoffEngine([ModelRunner(small, "small"), remote], tokenizer), remote
