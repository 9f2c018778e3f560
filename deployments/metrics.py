"""Prometheus metrics (ray.serve.metrics; Serve adds deployment / replica / app tags).

Every series goes two ways: Ray's metrics agent exports it with the `ray_` prefix, e.g.
`ray_backoff_tokens_total`, and a prometheus_client registry of the replica's own holds it
under the documented name, `backoff_tokens_total`, which the Ingress serves on the HTTP
port's GET /metrics (serving/exposition.py). Names use the glossary: small / large, source,
backoff rate, catch-up, threshold.
"""

from __future__ import annotations

import atexit
import threading
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry
from ray.serve import metrics

from backoff_core.types import GenerationResult, level_names
from deployments.serving.exposition import Series, series_of

if TYPE_CHECKING:  # torch: only where a model is loaded
    from backoff_core.runners.prefix_cache import PrefixCacheStats
    from deployments.serving.catchup_wire import ForwardRecord

_LENGTHS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024]
_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
_RATES = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
REFRESH_S = 5.0  # Ray 2.60's exporter drops a gauge value not set again within ~20 s


def _local(metric, tags: dict[str, str] | None):
    """A prometheus_client metric's child for `tags` (the metric itself when it has none)."""
    return metric.labels(**tags) if tags else metric


class Counter:
    """A ray.serve counter, and the same counts in a local registry (GET /metrics)."""

    def __init__(
        self, name: str, description: str, tag_keys: tuple[str, ...] = (), *, registry: CollectorRegistry
    ) -> None:
        self._ray = metrics.Counter(name, description, tag_keys)
        self._local = prometheus_client.Counter(name, description, tag_keys, registry=registry)

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self._ray.inc(value, tags=tags)
        _local(self._local, tags).inc(value)


class Histogram:
    """A ray.serve histogram, and the same observations in a local registry (GET /metrics)."""

    def __init__(
        self,
        name: str,
        description: str,
        boundaries: list[float],
        tag_keys: tuple[str, ...] = (),
        *,
        registry: CollectorRegistry,
    ) -> None:
        self._ray = metrics.Histogram(name, description, boundaries, tag_keys)
        self._local = prometheus_client.Histogram(name, description, tag_keys, registry=registry, buckets=boundaries)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._ray.observe(value, tags=tags)
        _local(self._local, tags).observe(value)


class Gauge:
    """A ray.serve gauge whose last value per tag set is set again every REFRESH_S seconds
    (a daemon thread shared by all of them), so a value set once (the threshold at start,
    an idle replica's KV use) stays exported instead of vanishing from Ray's /metrics; the
    local registry's (GET /metrics on the HTTP port) keeps its value by itself."""

    _all: list["Gauge"] = []
    _lock = threading.Lock()
    _thread: threading.Thread | None = None
    _stop = threading.Event()

    def __init__(
        self, name: str, description: str, tag_keys: tuple[str, ...] = (), *, registry: CollectorRegistry | None = None
    ) -> None:
        self._gauge = metrics.Gauge(name, description, tag_keys)
        self._local = prometheus_client.Gauge(name, description, tag_keys, registry=registry or CollectorRegistry())
        self._last: dict[tuple, float] = {}
        with Gauge._lock:
            Gauge._all.append(self)
            if Gauge._thread is None:
                Gauge._thread = threading.Thread(target=Gauge._refresh, name="gauge-refresh", daemon=True)
                Gauge._thread.start()
                atexit.register(Gauge._stop.set)  # no metrics calls while the interpreter winds down

    def set(self, value: float, tags: dict[str, str]) -> None:
        self._last[tuple(sorted(tags.items()))] = value
        self._gauge.set(value, tags=tags)
        _local(self._local, tags).set(value)

    @staticmethod
    def _refresh() -> None:
        while not Gauge._stop.wait(REFRESH_S):
            with Gauge._lock:
                gauges = list(Gauge._all)
            for g in gauges:
                for key, value in list(g._last.items()):
                    g._gauge.set(value, tags=dict(key))


class SmallMetrics:
    """SmallModel: requests, tokens by source, backoff rate, catch-ups, latency, threshold."""

    def __init__(self, num_levels: int) -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)  # GET /metrics: series()
        self.names = level_names(num_levels)
        self.requests = Counter(
            "backoff_requests",
            "Requests by outcome (finished, rejected, failed, cancelled; overloaded: the admission queue was full, "
            "queue_timeout: waited admission.queue_timeout_s in it).",
            ("outcome",),
            registry=r,
        )
        self.tokens = Counter("backoff_tokens", "Generated tokens by source model.", ("source",), registry=r)
        self.backoff_rate = Histogram(
            "backoff_request_backoff_rate", "Per request: share of tokens the small model produced.", _RATES, registry=r
        )
        self.catch_up_length = Histogram(
            "backoff_catch_up_length",
            "Pending tokens per catch-up (one session, one call).",
            _LENGTHS,
            ("level",),
            registry=r,
        )
        self.catch_up_batch = Histogram(
            "backoff_catch_up_batch_size",
            "Requests whose catch-ups one step sent together.",
            _SIZES,
            ("level",),
            registry=r,
        )
        self.latency = Histogram("backoff_request_latency_s", "Admission to last token.", _SECONDS, registry=r)
        self.first_token = Histogram("backoff_time_to_first_token_s", "Admission to first token.", _SECONDS, registry=r)
        self.threshold = Gauge(
            "backoff_threshold",
            "Threshold in the live config, or its router's default when it sets none "
            "(per boundary between models); published from the start.",
            ("boundary",),
            registry=r,
        )
        self.sessions_lost = Counter("backoff_sessions_lost", "Remote sessions lost and re-prefilled.", registry=r)
        self.degraded = Counter(
            "backoff_requests_degraded",
            "Finished requests that went on with the small model alone after a "
            "larger model failed (slow or unavailable).",
            registry=r,
        )

    def request(self, outcome: str) -> None:
        self.requests.inc(1, tags={"outcome": outcome})

    def finished(self, result: GenerationResult) -> None:
        self.request("finished")
        if result.degraded:
            self.degraded.inc(1)
        for level, n in enumerate(result.tokens_by_source()):
            if n:
                self.tokens.inc(n, tags={"source": self.names[level]})
        if result.sources:
            self.backoff_rate.observe(result.backoff_rate)
        for c in result.catch_ups:
            tags = {"level": self.names[c.level]}
            self.catch_up_length.observe(max(1, c.length - c.prompt_tokens), tags=tags)
            self.catch_up_batch.observe(c.batch_size, tags=tags)
        self.latency.observe(result.timings.total)
        self.first_token.observe(result.timings.first_token)

    def series(self, **labels: str) -> tuple[Series, ...]:
        return series_of([self.registry], **labels)

    def thresholds(self, values: list[float] | None) -> None:
        for i, t in enumerate(values or []):
            self.threshold.set(t, tags={"boundary": str(i)})


class LargeMetrics:
    """LargeModel: forward passes, their batch sizes and catch-up lengths, open sessions."""

    def __init__(self, name: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)  # GET /metrics: series()
        self.tags = {"model": name}
        self.forwards = Counter(
            "backoff_large_forward_passes", "Forward passes of a large model.", ("model",), registry=r
        )
        self.batch = Histogram(
            "backoff_large_forward_batch_size", "Sessions merged into one forward.", _SIZES, ("model",), registry=r
        )
        self.length = Histogram(
            "backoff_large_catch_up_length", "New tokens per session in a forward.", _LENGTHS, ("model",), registry=r
        )
        self.seconds = Histogram("backoff_large_forward_s", "Seconds per forward.", _SECONDS, ("model",), registry=r)
        self.sessions = Gauge("backoff_large_sessions", "Sessions held by this replica.", ("model",), registry=r)
        self.kv_metrics = KVMetrics()

    def forward(self, record: ForwardRecord) -> None:
        self.forwards.inc(1, tags=self.tags)
        self.batch.observe(record.batch_size, tags=self.tags)
        for k in record.lengths:
            self.length.observe(k, tags=self.tags)
        self.seconds.observe(record.seconds, tags=self.tags)

    def held(self, n: int) -> None:
        self.sessions.set(n, tags=self.tags)

    def kv(self, used: int, budget: int, evictions: int) -> None:
        self.kv_metrics.publish(self.tags["model"], used, budget, evictions)

    def series(self, **labels: str) -> tuple[Series, ...]:
        return series_of([self.registry, self.kv_metrics.registry], **labels)


class KVMetrics:
    """A model replica's KV budget: positions used and free, idle sessions evicted."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)  # GET /metrics: series()
        self.used = Gauge(
            "backoff_kv_tokens_used", "KV positions held by the replica's sessions.", ("model",), registry=r
        )
        self.free = Gauge(
            "backoff_kv_tokens_free",
            "KV positions left in the replica's budget (negative: live sessions grew past it).",
            ("model",),
            registry=r,
        )
        self.evictions = Counter(
            "backoff_kv_evictions",
            "Idle sessions evicted to make KV room (their requests re-prefill).",
            ("model",),
            registry=r,
        )
        self._evictions_seen: dict[str, int] = {}
        # prefix cache (backoff_core/runners/prefix_cache.py): counters fed from the runner's totals
        self.prefix_counters = {
            "hits": Counter(
                "backoff_prefix_cache_hits", "Prompt lookups that started from a cached prefix.", ("model",), registry=r
            ),
            "misses": Counter(
                "backoff_prefix_cache_misses", "Prompt lookups that found no cached block.", ("model",), registry=r
            ),
            "cached_tokens": Counter(
                "backoff_prefix_cache_cached_tokens",
                "Prompt positions loaded from the cache (not prefilled).",
                ("model",),
                registry=r,
            ),
            "lookup_tokens": Counter(
                "backoff_prefix_cache_lookup_tokens",
                "Cacheable prompt positions the lookups asked about.",
                ("model",),
                registry=r,
            ),
            "evicted_blocks": Counter(
                "backoff_prefix_cache_evicted_blocks",
                "Cached blocks evicted (LRU) to make room.",
                ("model",),
                registry=r,
            ),
        }
        self.prefix_tokens = Gauge(
            "backoff_prefix_cache_tokens", "Positions the prefix cache holds.", ("model",), registry=r
        )
        self._prefix_seen: dict[tuple[str, str], int] = {}

    def series(self, **labels: str) -> tuple[Series, ...]:
        return series_of([self.registry], **labels)

    def publish(self, model: str, used: int, budget: int, evictions: int) -> None:
        tags = {"model": model}
        self.used.set(used, tags=tags)
        self.free.set(budget - used, tags=tags)
        new = evictions - self._evictions_seen.get(model, 0)
        if new > 0:
            self.evictions.inc(new, tags=tags)
        self._evictions_seen[model] = evictions

    def prefix(self, model: str, stats: PrefixCacheStats) -> None:
        """A model's prefix cache: its totals since start, exported as counter increments."""
        tags = {"model": model}
        for field, counter in self.prefix_counters.items():
            total = getattr(stats, field)
            new = total - self._prefix_seen.get((model, field), 0)
            if new > 0:
                counter.inc(new, tags=tags)
            self._prefix_seen[(model, field)] = total
        self.prefix_tokens.set(stats.tokens, tags=tags)
