"""LargeModel deployment: M_L (or a medium level of a chain), one session per request.

Concurrent catch-up calls of many requests and many SmallRouter replicas are merged into
one forward by the CatchUpBatcher. Sessions register through `@serve.multiplexed` (the
session key is the multiplexed model id), so SessionAffinityRouter keeps sending a
session's calls here; they are freed on finish / cancel / disconnect (the router's close),
by TTL, and by the multiplexer's LRU bound.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from ray import serve
from ray.serve.config import RequestRouterConfig

from backoff_core.runner import ModelRunner

from .batcher import CatchUpBatcher, CatchUpCall, CatchUpReply, ForwardRecord
from .config import CatchUpConfig, ModelsConfig
from .metrics import LargeMetrics, level_names
from .models import load_level

AFFINITY = RequestRouterConfig(request_router_class="deployments.affinity:SessionAffinityRouter")
MAX_SESSIONS = 4096  # LRU bound of registered sessions per replica


@dataclass(frozen=True)
class LargeInfo:
    pid: int
    replica: str
    name: str
    sessions: tuple[str, ...]
    forward_passes: int
    calls: int
    lost: int
    waited_s: float
    forward_s: float
    batch_sizes: tuple[tuple[int, int], ...]  # (sessions in a forward, how many forwards)
    config: CatchUpConfig


class _Lease:
    """What the multiplexer holds per session; evicting it frees the session."""

    def __init__(self, key: str, batcher: CatchUpBatcher) -> None:
        self.key, self.batcher = key, batcher

    def __del__(self) -> None:
        self.batcher.close_soon(self.key)


@serve.deployment(request_router_config=AFFINITY, max_ongoing_requests=256)
class LargeModel:
    def __init__(self, models: dict, level: int, torch_threads: int | None = None) -> None:
        cfg = ModelsConfig.model_validate(models)
        self.name = level_names(cfg.num_levels)[level]
        self.runner = ModelRunner(load_level(cfg, level, torch_threads), self.name)
        self.metrics = LargeMetrics(self.name)
        self.config = CatchUpConfig()
        self.batcher = CatchUpBatcher(self.runner, on_forward=self._forwarded)
        self.reconfigure({})
        self._sweeper: asyncio.Task | None = None

    def reconfigure(self, user_config: dict) -> None:
        self.config = CatchUpConfig.model_validate(user_config or {})
        self.batcher.batching = self.config.batching
        self.batcher.max_batch_size = self.config.max_batch_size
        self.batcher.batch_wait_s = self.config.batch_wait_ms / 1000.0
        self.batcher.batch_gap_s = self.config.batch_gap_ms / 1000.0

    @serve.multiplexed(max_num_models_per_replica=MAX_SESSIONS)
    async def _register(self, key: str) -> _Lease:
        return _Lease(key, self.batcher)

    async def extend(self, call: CatchUpCall) -> CatchUpReply:
        """One session's catch-up: all its pending ids, merged with other sessions' calls."""
        self._start_sweeper()
        if serve.get_multiplexed_model_id() != call.key:
            raise ValueError("send a catch-up with multiplexed_model_id=<its session key>")
        if call.past == 0 or self.batcher.holds(call.key):
            await self._register(call.key)  # tells the routers that this replica holds it
        return await self.batcher.extend(call)

    async def close(self, key: str) -> None:
        await self.batcher.close(key)
        self.metrics.held(len(self.runner.session_ids()))

    def _forwarded(self, record: ForwardRecord) -> None:  # on the forward thread
        self.metrics.forward(record)
        self.metrics.held(len(self.runner.session_ids()))

    def info(self) -> LargeInfo:
        s = self.batcher.stats
        return LargeInfo(
            pid=os.getpid(), replica=serve.get_replica_context().replica_id.unique_id, name=self.name,
            sessions=tuple(self.runner.session_ids()), forward_passes=s.forward_passes, calls=s.calls,
            lost=s.lost, waited_s=s.waited_s, forward_s=s.forward_s, batch_sizes=tuple(sorted(s.batch_sizes.items())), config=self.config,
        )

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            ttl = self.config.session_ttl_s
            await asyncio.sleep(min(ttl / 4, 30.0))
            await self.batcher.expire(ttl)
            self.metrics.held(len(self.runner.session_ids()))

    def __del__(self) -> None:
        self.batcher.shutdown()
