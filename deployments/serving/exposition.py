"""GET /metrics on the HTTP port: every replica's series in Prometheus text, under the names the
docs use (no `ray_` prefix; Ray's metrics agent still exports them too, with it).

Each model replica records its series twice (deployments/metrics.py): into Ray's metrics and
into a prometheus_client registry of its own, which `series_of` turns into Series records for
the wire. The Ingress asks every SmallModel replica for its own (one broadcast) and one of them
for every larger replica's (a broadcast per larger deployment), adds nothing of its own, and
renders them in one exposition: a sample carries its replica's `deployment` and `replica`
labels, as Ray's export does, so `sum by (...)` in a query adds the replicas up.
No Ray here (the handles are passed in).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0  # a replica slower than this is left out of one scrape (and logged)
Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs


@dataclass(frozen=True)
class Sample:
    name: str  # the line's name: backoff_requests_total, backoff_request_latency_s_bucket ...
    labels: Labels
    value: float


@dataclass(frozen=True)
class Series:
    """One metric family of one replica."""

    name: str  # the family's: backoff_requests (a counter), backoff_request_latency_s (a histogram)
    kind: str  # counter, gauge or histogram
    help: str
    samples: tuple[Sample, ...]


def series_of(registries: Iterable[CollectorRegistry], **labels: str) -> tuple[Series, ...]:
    """The families of prometheus_client registries, each sample given `labels`
    (prometheus_client's `_created` timestamps left out: Ray exports none)."""
    out = []
    for registry in registries:
        for family in registry.collect():
            samples = tuple(
                Sample(s.name, tuple(sorted({**s.labels, **labels}.items())), s.value)
                for s in family.samples
                if not s.name.endswith("_created")
            )
            out.append(Series(family.name, family.type, family.documentation, samples))
    return tuple(out)


class _Families:
    """A prometheus_client collector over fixed families (what generate_latest renders)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def render(series: Iterable[Series]) -> bytes:
    """One exposition of many replicas' series: a family once, its samples from all of them (a
    sample two replicas report under the same labels is their sum)."""
    families: dict[str, tuple[Series, dict[tuple[str, Labels], float]]] = {}
    for s in series:
        _, values = families.setdefault(s.name, (s, {}))
        for sample in s.samples:
            key = (sample.name, sample.labels)
            values[key] = values.get(key, 0.0) + sample.value
    out = []
    for name, (first, values) in sorted(families.items()):
        family = Metric(name, first.help, first.kind)
        for (sample_name, labels), value in values.items():
            family.add_sample(sample_name, dict(labels), value)
        out.append(family)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(out))
    return generate_latest(registry)


async def answers(broadcast, what: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> list[Series]:
    """The series of every replica a handle's `broadcast(...)` reached; those that failed or
    did not answer in time are logged and left out."""
    replies = await broadcast.results_async(timeout_s=timeout_s, return_exceptions=True)
    failed = [r for r in replies if isinstance(r, BaseException)]
    if failed:
        log.warning("GET /metrics: %d of %d %s replicas did not answer: %r", len(failed), len(replies), what, failed[0])
    return [s for r in replies if not isinstance(r, BaseException) for s in r]


async def scrape(small) -> tuple[bytes, str]:
    """(body, content type) of GET /metrics: the series of every SmallModel replica and of every
    replica of the larger deployments, asked through the SmallModel deployment's handle."""
    series = await answers(small.broadcast("metric_series"), "SmallModel")
    try:
        series += await small.larger_metric_series.remote()
    except Exception:  # noqa: BLE001 - the SmallModels' series still go out
        log.warning("GET /metrics: no SmallModel answered for the larger models' series", exc_info=True)
    return render(series), CONTENT_TYPE_LATEST
