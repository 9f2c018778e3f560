"""SmallModel deployment: M_S + decision function + the step loop of every request.

Holds M_S as a local runner (a ModelRunner, or a StaticRunner given a KV budget) and a
BackoffEngine whose larger levels are RemoteLarge proxies to LargeModel deployments. One
thread runs the engine (EngineLoop), so the M_S steps of concurrent requests are batched;
`generate` streams one request's items once the AdmissionGate lets it in (past its FIFO
queue, or after queue_timeout_s in it, it refuses: Overloaded). The routing config (router, threshold, target backoff
rate) is this deployment's user_config:
`reconfigure()` swaps it and the engine thread reads it once per step.

Faults: a catch-up without a reply within `large_timeout_s` degrades its request to M_S
alone (or fails it: `on_large_failure`). The sessions this replica holds on the larger
deployments are leased (large.py): a task on the event loop renews the lease of this
replica on every replica of each larger deployment, so that if this replica dies they are
freed within `lease_s` instead of the TTL.

The model stack (torch, transformers, the engine and its runners) is imported where a
replica loads or runs its models, not at module level: Serve's app builder imports this
module in a process of its own at every deploy and needs only the class (tests/test_layout.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import importlib
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from backoff_core.engine.gc_heap import GCStats, GCWatch
from backoff_core.runners.kv_budget import Resolved, kv_evictions, kv_tokens, resolved
from backoff_core.types import GenerationRequest, GenerationResult, KVSpec, TokenEvent, level_names
from deployments.large import replica_kv
from deployments.metrics import KVMetrics, SmallMetrics
from deployments.rank_actors import rank_launcher
from deployments.serving.admission import AdmissionGate, Overloaded, live_slots, queue_depth
from deployments.serving.catchup_wire import CatchUpCall
from deployments.serving.chaos import FaultInjector
from deployments.serving.config import AdmissionConfig, AppArgs, RoutingConfig, handle_options
from deployments.serving.engine_loop import EngineLoop
from deployments.serving.exposition import Series, answers
from deployments.serving.outcomes import Admitted, Failed, Rejected
from deployments.serving.requests import ServeRequest, generation_request, truncated
from deployments.streams import REPLICA_LOST

log = logging.getLogger(__name__)

# one request's stream: Admitted, tokens (one, or several that queued up), the result;
# or Rejected / Failed / Overloaded instead
StreamItem = Admitted | TokenEvent | tuple[TokenEvent, ...] | GenerationResult | Rejected | Failed | Overloaded


STEP_THREAD_SWITCH_S = 0.0005  # sys.setswitchinterval in a SmallModel replica
RECENT_IDS = 256  # request ids info() reports


async def _until(event: asyncio.Event, timeout_s: float) -> None:
    """Wait until `event` is set or `timeout_s` has passed (cancellable)."""
    if not event.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await event.wait()


def _import(path: str):
    """'module:attribute' -> the attribute (AppArgs.engine_factory)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class ServeEndpoint:
    """RemoteLarge's view of a LargeModel deployment: calls routed by session key."""

    transport_errors = REPLICA_LOST

    def __init__(self, handle: DeploymentHandle, transport: str = "actor") -> None:
        self.handle = handle  # renewals: a broadcast, over actor calls
        self.calls = handle.options(**handle_options(transport))  # extend / close, per step

    def extend(self, call: CatchUpCall):
        return self.calls.options(multiplexed_model_id=call.session_key).extend.remote(call)

    def close(self, session_key: str) -> None:
        self.calls.options(multiplexed_model_id=session_key).close.remote(session_key)

    async def renew(self, owner: str) -> list[float]:
        """Renew `owner`'s lease on every replica; the leases (s) they granted."""
        granted = await self.handle.broadcast("renew", owner).results_async(timeout_s=10.0, return_exceptions=True)
        return [g for g in granted if isinstance(g, (int, float))]


@dataclass(frozen=True)
class SmallInfo:
    pid: int
    replica: str
    policy: RoutingConfig
    steps: int
    live: int  # requests in the step loop
    requests: tuple[str, ...]  # ids of the live requests
    admitted: int  # slots of the admission gate held (live + on their way in)
    waiting: int  # requests waiting for a slot (the admission queue)
    cancelled: int  # requests whose caller went away (disconnect, cancel) before the end
    sessions_lost: int
    catch_up_calls: int
    catch_up_wait_s: float  # step-loop time spent waiting for catch-up replies
    busy_s: float = 0.0  # step-loop time spent in steps
    node: str = ""  # the Ray node the replica runs on
    served: int = 0  # requests that reached generate() (prefix routing: where they went)
    recent: tuple[str, ...] = ()  # ids of the last RECENT_IDS of them, oldest first
    flights: int = 0  # catch-ups run in flight beside the steps (overlap_catch_ups)
    launched_ahead: tuple[int, int] | None = None  # M_S's rows launched ahead, taken by a step (None: off)
    gc: GCStats | None = None  # the collector's pauses since load (Ray Serve's freeze included) and the heap frozen
    context_window: int | None = None  # prompt + generated tokens one request may hold (GET /v1/models' max_model_len)
    admission: tuple[int, int, int, int] = (0, 0, 0, 0)  # live slots, queue depth, refused (queue full), timed out
    resolved: Resolved | None = None  # M_S's storage, graphs and layers as `auto` became them


@serve.deployment(max_ongoing_requests=64)
class SmallModel:
    def __init__(self, args: dict, *levels: DeploymentHandle) -> None:
        from backoff_core.engine import ahead
        from backoff_core.engine.engine import BackoffEngine
        from backoff_core.parallel.ranks import parallel_runner
        from deployments.serving.models import load_small_side
        from deployments.serving.remote import RemoteLarge

        self.args = AppArgs.model_validate(args)
        # the step thread wakes from the device (or a sleep) needing the GIL while Serve's event
        # loops hold it: at the default 5 ms switch interval a 2 ms step waited up to 5 ms more
        sys.setswitchinterval(STEP_THREAD_SWITCH_S)
        side = load_small_side(self.args.models, self.args.torch_threads)
        self.tokenizer = side.tokenizer
        self.hidden_size = side.hidden_size
        n = self.args.models.num_levels
        names = level_names(n)
        vocab = int(side.model.get_output_embeddings().weight.shape[0])
        self.owner = serve.get_replica_context().replica_id.unique_id  # whose lease keeps our sessions
        self.endpoints = [ServeEndpoint(h, self.args.handle_transport) for h in levels]
        self.remotes = [RemoteLarge(e, names[i + 1], vocab, owner=self.owner) for i, e in enumerate(self.endpoints)]
        self._renewals: asyncio.Task | None = None
        if len(self.remotes) != n - 1:
            raise ValueError(f"a chain of {n} models needs {n - 1} larger deployments, got {len(self.remotes)}")
        self.kv = replica_kv(self.args.models, side.model, "small")
        models = self.args.models
        ranks = models.tensor_parallel.small
        small = parallel_runner(
            side.model,
            "small",
            self.kv,
            True,
            models.classifier,
            models.prefix_spec(),
            ranks,
            launch=rank_launcher(ranks),
        )
        self.faults = FaultInjector(small)  # inject_fault_seed
        self.small_runner = small
        self.kv_metrics = KVMetrics()
        make_engine = _import(self.args.engine_factory) if self.args.engine_factory else BackoffEngine
        engine = make_engine(
            [self.faults, *self.remotes],
            side.tokenizer,
            classifier_path=self.args.models.classifier,
            hidden_size=side.hidden_size,
            context_window=side.context_window,
            prefill_chunk_tokens=self.args.prefill_chunk_tokens,
            catch_up_wait_ms=self.args.catch_up_wait_ms,
            overlap_catch_ups=self.args.overlap_catch_ups,
            launch_ahead=ahead.resolve(self.args.launch_ahead, small, self.args.overlap_catch_ups),
        )
        self.metrics = SmallMetrics(n)
        self.gate = _gate(self.args.admission, self.kv)
        self._lost_reported = 0
        self._cancelled = 0
        self._served: collections.deque[str] = collections.deque(maxlen=RECENT_IDS)
        self._served_count = 0
        self.loop: EngineLoop[RoutingConfig] = EngineLoop(engine, self._admit, self.args.routing, self._finished)
        self.reconfigure(self.args.routing.model_dump())
        self.gc = GCWatch.shared()  # Ray Serve freezes the startup heap once __init__ returns (gc_heap.py)
        self.loop.start()

    def reconfigure(self, user_config: dict) -> None:
        policy = RoutingConfig.model_validate(user_config or {})
        self.loop.policy = policy  # one reference store: the engine thread sees old or new, never half
        for remote in self.remotes:
            remote.timeout_s = policy.large_timeout_s
        self.metrics.thresholds(self._config_thresholds(policy))

    def _config_thresholds(self, policy: RoutingConfig) -> list[float]:
        """The config's thresholds, else its router's defaults: what requests that set none
        start from, published from the start (a config that names none still has them)."""
        from backoff_core.routing.routers import build_router

        if policy.thresholds is not None:
            return list(policy.thresholds)
        try:
            router = build_router(
                policy.router,
                rate=policy.rate,
                classifier_path=self.args.models.classifier,
                hidden_size=self.hidden_size,
            )
        except (ValueError, OSError):  # an unknown router: every request says so
            return []
        return list(router.default_thresholds(self.args.models.num_levels))

    async def generate(self, request: ServeRequest, tokens: bool = True) -> AsyncIterator[StreamItem]:
        """Admitted, then the committed tokens (TokenEvents; several at once as a tuple when
        they queued up meanwhile or waited for the message budget, StreamConfig; none unless
        `tokens`), then the GenerationResult.
        Overloaded alone when the queue is full or the request waited queue_timeout_s in it."""
        self._start_renewals()
        self._served.append(request.request_id)
        self._served_count += 1
        if (refused := await self.gate.enter()) is not None:  # the queue was full, or the wait too long
            self.metrics.request(refused.code)  # overloaded / queue_timeout: counted by outcome
            yield refused
            return
        try:
            async with contextlib.aclosing(self._stream(request, tokens)) as items:  # its finally runs first
                async for item in items:
                    yield item
        finally:
            self.gate.leave()

    async def _stream(self, request: ServeRequest, tokens: bool) -> AsyncIterator[StreamItem]:
        items = self.loop.submit(request, tokens)
        held: list = []  # an item read while gathering tokens, for the next round
        ended = False
        clock, sent = asyncio.get_running_loop().time, None  # when the last token message went
        try:
            while True:
                item = held.pop() if held else await items.get()
                if isinstance(item, TokenEvent):
                    if sent is not None and (wait := self._token_gap() - (clock() - sent)) > 0:
                        await _until(items.ended, wait)  # the message budget (StreamConfig), unless it ended
                    batch = [item]
                    while sent is not None and not items.empty() and not held:  # the first token goes alone
                        nxt = items.get_nowait()
                        (batch if isinstance(nxt, TokenEvent) else held).append(nxt)
                    item = batch[0] if len(batch) == 1 else tuple(batch)
                    sent = clock()
                if isinstance(item, Admitted) and item.prompt_ids is not None:  # echo: the prompt as text
                    text = self.tokenizer.decode(list(item.prompt_ids))  # special tokens as text, as vLLM's echo
                    item = dataclasses.replace(item, prompt_text=text)
                ended = isinstance(item, (GenerationResult, Rejected, Failed))
                if isinstance(item, (Rejected, Failed)):
                    self.metrics.request("rejected" if isinstance(item, Rejected) else "failed")
                yield item
                if ended:
                    return
        finally:
            if not ended:  # the caller went away (disconnect, cancel): free the sessions now
                self.loop.cancel(request.request_id)
                self.metrics.request("cancelled")
                self._cancelled += 1

    def _token_gap(self) -> float:
        """Seconds a stream's token message waits after its previous one: this replica's
        message budget shared by its live streams, capped at max_delay_ms."""
        budget = self.args.stream
        return min(self.loop.live() / budget.max_messages_per_s, budget.max_delay_ms / 1e3)

    def info(self) -> SmallInfo:
        return SmallInfo(
            pid=os.getpid(),
            replica=serve.get_replica_context().replica_id.unique_id,
            policy=self.loop.policy,
            steps=self.loop.steps,
            live=self.loop.live(),
            requests=self.loop.live_ids(),
            admitted=self.gate.live,
            waiting=self.gate.waiting,
            cancelled=self._cancelled,
            sessions_lost=sum(r.lost_sessions for r in self.remotes),
            catch_up_calls=sum(r.calls for r in self.remotes),
            catch_up_wait_s=sum(r.wait_s for r in self.remotes),
            busy_s=self.loop.busy_s,
            node=ray.get_runtime_context().get_node_id(),
            served=self._served_count,
            recent=tuple(self._served),
            flights=getattr(getattr(self.loop.engine, "flights", None), "launched", 0),
            launched_ahead=_launched_ahead(self.loop.engine),
            gc=self.gc.stats(),
            context_window=getattr(self.loop.engine, "context_window", None),  # an engine_factory's may have none
            admission=(self.gate.max_live, self.gate.max_waiting, self.gate.refused, self.gate.timed_out),
            resolved=resolved(self.small_runner, self.kv),
        )

    def metric_series(self) -> tuple[Series, ...]:
        """This replica's Prometheus series, for the Ingress's GET /metrics (exposition.py)."""
        labels = {"deployment": serve.get_replica_context().deployment, "replica": self.owner}
        return self.metrics.series(**labels) + self.kv_metrics.series(**labels)

    async def larger_metric_series(self) -> list[Series]:
        """Every replica's series of each larger deployment (one broadcast each), for GET /metrics."""
        return [s for e in self.endpoints for s in await answers(e.handle.broadcast("metric_series"), "larger model")]

    def _start_renewals(self) -> None:
        if self._renewals is None or self._renewals.done():
            self._renewals = asyncio.get_running_loop().create_task(self._renew_leases())

    async def _renew_leases(self) -> None:
        """Every lease_s / 3 (the shortest lease granted), on every larger replica."""
        period = 1.0
        while True:
            try:
                granted = [g for e in self.endpoints for g in await e.renew(self.owner)]
                period = min(granted, default=3 * period) / 3
            except Exception:  # noqa: BLE001 - a deployment being replaced; try again soon
                log.warning("lease renewal failed", exc_info=True)
            await asyncio.sleep(period)

    # -- engine thread ----------------------------------------------------------------------
    def _admit(self, request: ServeRequest, policy: RoutingConfig) -> GenerationRequest:
        from backoff_core.models.prompts import encode_chat, encode_prompt

        if request.messages is not None:
            ids = encode_chat(self.tokenizer, [{"role": r, "content": c} for r, c in request.messages])
        elif request.prompt is not None:
            ids = encode_prompt(self.tokenizer, request.prompt)
        else:
            ids = list(request.prompt_ids)
        if request.truncate_prompt_tokens is not None:  # before the limit, as vLLM truncates
            ids = truncated(ids, request.truncate_prompt_tokens, getattr(self.loop.engine, "context_window", None))
        limit = self.args.limits.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise ValueError(f"the prompt is {len(ids)} tokens; the limit is {limit} (limits.max_prompt_tokens)")
        if policy.inject_fault_seed is not None and request.sampling.seed == policy.inject_fault_seed:
            self.faults.doom(request.request_id)
        return generation_request(request, ids, policy)

    def _finished(self, result: GenerationResult) -> None:
        self.metrics.finished(result)
        lost = sum(r.lost_sessions for r in self.remotes)
        if lost > self._lost_reported:
            self.metrics.sessions_lost.inc(lost - self._lost_reported)
            self._lost_reported = lost
        self.kv_metrics.publish(
            "small", kv_tokens(self.small_runner), self.kv.budget_tokens, kv_evictions(self.small_runner)
        )
        self.kv_metrics.prefix("small", self.small_runner.prefix_stats())

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()


def _gate(admission: AdmissionConfig, kv: KVSpec) -> AdmissionGate:
    """The replica's admission: its live slots (fewer than max_live_requests where M_S's static
    KV holds fewer sessions) and a FIFO queue of `auto` = QUEUE_PER_LIVE x them, or as set."""
    live = live_slots(admission.max_live_requests, kv.budget_tokens // kv.max_len if kv.static else None)
    depth = queue_depth(admission.max_waiting_requests, live)
    return AdmissionGate(live, depth, admission.queue_timeout_s, admission.retry_after_s)


def _launched_ahead(engine) -> tuple[int, int] | None:
    """launch_ahead's rows launched and taken so far, where the engine launches (ahead.py)."""
    launcher = getattr(engine, "ahead", None)
    return None if launcher is None else (launcher.rows_launched, launcher.rows_used)
