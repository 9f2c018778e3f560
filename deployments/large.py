"""LargeModel deployment: M_L (or a medium level of a chain), one session per request.

Concurrent catch-up calls of many requests and many SmallModel replicas are merged into
one forward by the CatchUpBatcher. Sessions register through `@serve.multiplexed` (the
session key is the multiplexed model id), so SessionAffinity keeps sending a
session's calls here; they are freed on finish / cancel / disconnect (the router's close),
by TTL, by the multiplexer's LRU bound, and by lease.

The lease frees the sessions of a SmallModel replica that died (it cannot close them):
every catch-up call names its owner (the router replica), and each router broadcasts
`renew(owner)` to every replica of this deployment every lease_s / 3 (Serve's
`handle.broadcast`, one call per replica: the cost does not grow with the sessions).
The sweeper frees the sessions of owners silent for lease_s. A live router whose renewals
stall for that long (an overloaded event loop) loses its sessions too; its next catch-up
is answered `lost` and re-prefilled (latency, not the request). A hung router that still
renews keeps them, until TTL.

Memory is bounded by the replica's KV budget (`models.kv_budget_tokens`, resolved here when
`auto`): the batcher evicts idle sessions LRU and refuses new ones the live sessions leave
no room for (batcher.py); `info()` and the kv metrics report what is used.

Tensor parallelism (`models.tensor_parallel`, backoff_core/parallel): the replica holds rank 0
of M_L and drives N - 1 rank actors in its placement group of N bundles on one node
(app.with_ranks, rank_actors.py; without Ray, rank processes of its own); a catch-up is still
one call to the replica. A rank that dies ends the replica (lose_replica): callers see a lost
LargeModel, the health check fails, and Serve starts a new replica with all its ranks.

The model stack (torch, transformers, the runners) is imported where a replica loads or
runs its model, not at module level: Serve's app builder imports this module in a process
of its own at every deploy and needs only the class (tests/test_layout.py holds it).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from backoff_core.engine.gc_heap import GCStats, GCWatch
from backoff_core.errors import RankFailure
from backoff_core.runners.kv_budget import Resolved, describe, kv_evictions, kv_tokens, resolved
from backoff_core.types import KVSpec, level_names
from deployments.metrics import LargeMetrics
from deployments.rank_actors import rank_launcher
from deployments.serving.catchup_wire import CatchUpCall, CatchUpReply, ForwardRecord
from deployments.serving.config import CatchUpConfig
from deployments.serving.exposition import Series
from deployments.serving.models_config import ModelsConfig

if TYPE_CHECKING:
    from deployments.serving.batcher import CatchUpBatcher

log = logging.getLogger(__name__)
AFFINITY = RequestRouterConfig(request_router_class="deployments.affinity:SessionAffinity")
MAX_SESSIONS = 4096  # LRU bound of registered sessions per replica (memory is bounded by the KV budget)


def replica_kv(cfg: ModelsConfig, model, name: str) -> KVSpec:
    """This replica's KV budget (`auto` resolved on its device and its share of the GPU), logged."""
    share = ray.get_runtime_context().get_assigned_resources().get("GPU", 1.0) if ray.is_initialized() else 1.0
    kv = cfg.kv_spec(model, gpu_share=share)
    print(f"{name}: {describe(kv, model)}", flush=True)  # the replica's log: what `auto` became
    return kv


def lose_replica(name: str, exc: Exception) -> None:
    """A tensor-parallel rank died (ranks.py): the replica goes as a whole. Its callers see a
    lost LargeModel (a transport error: they re-prefill on another replica, or degrade), as
    for any replica that dies, and Serve starts a new one with all its ranks."""
    log.error("%s: %s; this replica exits", name, exc)
    os._exit(1)


@dataclass(frozen=True)
class LargeInfo:
    pid: int
    replica: str
    name: str
    sessions: tuple[str, ...]
    forward_passes: int
    calls: int
    lost: int
    owners: tuple[tuple[str, int], ...]  # (SmallModel replica, sessions held for it)
    orphans_freed: int  # sessions freed because their owner's lease expired
    waited_s: float
    forward_s: float
    batch_sizes: tuple[tuple[int, int], ...]  # (sessions in a forward, how many forwards)
    config: CatchUpConfig
    kv_budget_tokens: int = 0  # the resolved budget
    kv_tokens: int = 0  # positions held now (per-session caches; static: slots taken x max_len)
    kv_evictions: int = 0  # idle sessions evicted to make room
    kv_refused: int = 0  # new sessions refused for want of room
    node: str = ""  # the Ray node the replica runs on
    gc: GCStats | None = None  # the collector's pauses since load (Ray Serve's freeze included) and the heap frozen
    tensor_parallel: int = 1  # ranks M_L is split over (backoff_core/parallel)
    collective_s: float = 0.0  # rank 0's time in the ranks' all-reduces and gathers since load
    ranks: tuple[tuple[str, int], ...] = ()  # (Ray node, pid) of ranks 1..N-1 (their node: the replica's)
    resolved: Resolved | None = None  # what `auto` became: static KV, graphs, compiled layers, ragged


class _Registration:
    """What the multiplexer holds per session; evicting it frees the session."""

    def __init__(self, session_key: str, batcher: CatchUpBatcher) -> None:
        self.session_key, self.batcher = session_key, batcher

    def __del__(self) -> None:
        self.batcher.close_soon(self.session_key)


@serve.deployment(request_router_config=AFFINITY, max_ongoing_requests=256)
class LargeModel:
    def __init__(self, models: dict, level: int, torch_threads: int | None = None) -> None:
        from backoff_core.parallel.ranks import parallel_runner
        from deployments.serving.batcher import CatchUpBatcher
        from deployments.serving.models import load_level, rank_device

        cfg = ModelsConfig.model_validate(models)
        self.name = level_names(cfg.num_levels)[level]
        ranks = cfg.tensor_parallel.size(level, cfg.num_levels)  # > 1: this replica drives N - 1 more ranks
        model = load_level(cfg, level, torch_threads, host=ranks > 1)  # split on the host, each rank to its GPU
        self.kv = replica_kv(cfg, model, self.name)
        self.runner = parallel_runner(
            model,
            self.name,
            self.kv,
            prefix_cache=cfg.prefix_spec(),
            tensor_parallel=ranks,
            device=rank_device(cfg),
            launch=rank_launcher(ranks),
        )
        self.metrics = LargeMetrics(self.name)
        self.config = CatchUpConfig()
        self.batcher = CatchUpBatcher(self.runner, on_forward=self._forwarded)
        self.reconfigure({})
        self._sweeper: asyncio.Task | None = None
        self._held()  # the KV budget and sessions published from the start (GET /metrics)
        self.gc = GCWatch.shared()  # Ray Serve freezes the startup heap once __init__ returns (gc_heap.py)

    def check_health(self) -> None:
        """Serve restarts a replica whose tensor-parallel group broke (a rank died: ranks.py)."""
        if not getattr(self.runner, "healthy", True):
            raise RuntimeError(f"{self.name}: tensor-parallel group broken ({self.runner.broken})")

    def reconfigure(self, user_config: dict) -> None:
        self.config = CatchUpConfig.model_validate(user_config or {})
        self.batcher.batching = self.config.batching
        self.batcher.max_batch_size = self.config.max_batch_size
        self.batcher.batch_wait_s = self.config.batch_wait_ms / 1000.0
        self.batcher.batch_gap_s = self.config.batch_gap_ms / 1000.0

    @serve.multiplexed(max_num_models_per_replica=MAX_SESSIONS)
    async def _register(self, session_key: str) -> _Registration:
        return _Registration(session_key, self.batcher)

    async def extend(self, call: CatchUpCall) -> CatchUpReply:
        """One session's catch-up: all its pending ids, merged with other sessions' calls."""
        self._start_sweeper()
        if serve.get_multiplexed_model_id() != call.session_key:
            raise ValueError("send a catch-up with multiplexed_model_id=<its session key>")
        if self.config.inject_delay_ms:  # chaos knob: a slow M_L
            await asyncio.sleep(self.config.inject_delay_ms / 1000.0)
        if call.past == 0 or self.batcher.holds(call.session_key):
            await self._register(call.session_key)  # tells the routers that this replica holds it
        try:
            return await self.batcher.extend(call)
        except RankFailure as exc:
            lose_replica(self.name, exc)
            raise

    async def renew(self, owner: str) -> float:
        """The SmallModel replica `owner` is alive; returns the lease (s) it must renew within."""
        self._start_sweeper()
        self.batcher.renew(owner)
        return self.config.lease_s

    async def close(self, session_key: str) -> None:
        await self.batcher.close(session_key)
        self._held()

    def _forwarded(self, record: ForwardRecord) -> None:  # on the forward thread
        self.metrics.forward(record)
        self._held()

    def _held(self) -> None:
        self.metrics.held(len(self.runner.request_ids()))
        self.metrics.kv(kv_tokens(self.runner), self.kv.budget_tokens, kv_evictions(self.runner))
        self.metrics.kv_metrics.prefix(self.name, self.runner.prefix_stats())

    def info(self) -> LargeInfo:
        s = self.batcher.stats
        node = ray.get_runtime_context().get_node_id()
        return LargeInfo(
            pid=os.getpid(),
            replica=serve.get_replica_context().replica_id.unique_id,
            name=self.name,
            sessions=tuple(self.runner.request_ids()),
            forward_passes=s.forward_passes,
            calls=s.calls,
            lost=s.lost,
            owners=tuple(sorted(self.batcher.owners().items())),
            orphans_freed=s.orphans_freed,
            waited_s=s.waited_s,
            forward_s=s.forward_s,
            batch_sizes=tuple(sorted(s.batch_sizes.items())),
            config=self.config,
            kv_budget_tokens=self.kv.budget_tokens,
            kv_tokens=kv_tokens(self.runner),
            kv_evictions=kv_evictions(self.runner),
            kv_refused=s.refused,
            node=node,
            gc=self.gc.stats(),
            tensor_parallel=self.runner.spec.size if hasattr(self.runner, "comm") else 1,
            collective_s=self.runner.comm.seconds if hasattr(self.runner, "comm") else 0.0,
            ranks=tuple((link.node or node, link.pid) for link in getattr(self.runner, "links", ())),
            resolved=resolved(self.runner, self.kv),
        )

    async def metric_series(self) -> tuple[Series, ...]:
        """This replica's Prometheus series, for the Ingress's GET /metrics (exposition.py)."""
        context = serve.get_replica_context()
        return self.metrics.series(deployment=context.deployment, replica=context.replica_id.unique_id)

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        from backoff_core.models.kernels import trim_heap

        while True:
            cfg = self.config
            await asyncio.sleep(min(cfg.session_ttl_s / 4, cfg.lease_s / 4, 30.0))
            await self.batcher.expire(cfg.session_ttl_s)
            orphans = await self.batcher.expire_leases(cfg.lease_s)
            if orphans:
                log.warning("%s: freed %d sessions whose router stopped renewing its lease", self.name, len(orphans))
            self._held()
            await asyncio.get_running_loop().run_in_executor(None, trim_heap)  # RSS follows what is held

    def __del__(self) -> None:
        self.batcher.shutdown()
