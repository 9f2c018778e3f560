"""Gauges are set again periodically: Ray 2.60's exporter drops a value not set within
~20 s, so a threshold published once at start vanished from /metrics (CI saw it)."""

from __future__ import annotations

import time

from deployments import metrics


class FakeGauge:
    def __init__(self, name, description, tag_keys=()):
        self.sets = []

    def set(self, value, tags):
        self.sets.append((value, dict(tags)))


def test_a_gauge_set_once_is_set_again_until_it_changes(monkeypatch):
    monkeypatch.setattr(metrics.metrics, "Gauge", FakeGauge)
    monkeypatch.setattr(metrics, "REFRESH_S", 0.05)
    monkeypatch.setattr(metrics.Gauge, "_all", [])
    monkeypatch.setattr(metrics.Gauge, "_thread", None)
    gauge = metrics.Gauge("backoff_threshold", "test", ("boundary",))
    gauge.set(2.0, tags={"boundary": "0"})
    deadline = time.monotonic() + 10
    while len(gauge._gauge.sets) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gauge._gauge.sets[:3] == [(2.0, {"boundary": "0"})] * 3
    gauge.set(0.25, tags={"boundary": "0"})
    n = len(gauge._gauge.sets)
    while len(gauge._gauge.sets) < n + 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gauge._gauge.sets[-1] == (0.25, {"boundary": "0"})
