"""GET /metrics on the HTTP port (deployments/serving/exposition.py): the Ingress over a
SmallModel and a LargeModel of tiny models (tests/support/serve_fakes.py) behind uvicorn, no Ray.
The counts it serves are those of the requests sent; its names are the ones docs/serving.md's
table documents (both ways) and the only ones the Grafana dashboard queries."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments import ingress
from tests.support.remote_fakes import LoopThread
from tests.support.serve_fakes import FakeHandle, ingress_replica, large_replica, serving, small_replica

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deployments" / "grafana" / "backoff.json"
N = 5  # requests sent before the scrapes
THRESHOLD = 0.4  # the entropy router's: both models serve the tiny pair's greedy tokens


@pytest.fixture(scope="module")
def served(pair, tokenizer):
    lt = LoopThread()
    with pytest.MonkeyPatch.context() as patch:
        large = large_replica(patch, pair[1])
        routing = {"routing": {"router": "entropy", "thresholds": [THRESHOLD]}}
        small = small_replica(patch, pair[0], tokenizer, [FakeHandle([large], lt)], routing)
        ingress_replica(patch, small)
        try:
            with serving(ingress.app) as base:
                usages = []
                for i in range(N):
                    body = {"prompt": [3 + i, 4, 5], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
                    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
                    assert reply.status_code == 200, reply.text
                    usages.append(reply.json()["usage"])
                yield base, small, large, usages
        finally:
            small.loop.stop()
            large.batcher.shutdown()
            lt.stop()


def _scrape(base: str) -> tuple[httpx.Response, dict[str, float], set[str]]:
    """The reply, {sample line's name and labels: value}, and the names its TYPE lines declare."""
    reply = httpx.get(f"{base}/metrics", timeout=30)
    assert reply.status_code == 200, reply.text
    values = {}
    for family in text_string_to_metric_families(reply.text):
        for s in family.samples:
            key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "replica") + "}"
            values[key] = values.get(key, 0.0) + s.value
    declared = set(re.findall(r"^# TYPE (\S+) \S+$", reply.text, re.M))
    return reply, values, declared


def test_metrics_counts_the_requests_served_under_the_documented_names(served):
    base, small, large, usages = served
    reply, values, declared = _scrape(base)
    assert reply.headers["content-type"].startswith("text/plain")
    assert not re.search(r"^ray_", reply.text, re.M)  # Ray's prefix is its exporter's, not ours
    small_labels, large_labels = "deployment=test", "deployment=test,model=large"
    assert values[f"backoff_requests_total{{{small_labels},outcome=finished}}"] == N
    small_tokens, large_tokens = (sum(u[k] for u in usages) for k in ("small_tokens", "large_tokens"))
    assert small_tokens > 0 and large_tokens > 0  # both models served
    assert values[f"backoff_tokens_total{{{small_labels},source=small}}"] == small_tokens
    assert values[f"backoff_tokens_total{{{small_labels},source=large}}"] == large_tokens
    assert values[f"backoff_request_latency_s_count{{{small_labels}}}"] == N
    assert values[f"backoff_request_backoff_rate_count{{{small_labels}}}"] == N
    assert values[f"backoff_threshold{{boundary=0,{small_labels}}}"] == THRESHOLD
    # the LargeModel's series, asked through the SmallModel: its own counts
    info = large.info()
    assert info.forward_passes > 0
    assert values[f"backoff_large_forward_passes_total{{{large_labels}}}"] == info.forward_passes
    assert values[f"backoff_large_forward_batch_size_count{{{large_labels}}}"] == info.forward_passes
    assert values[f"backoff_kv_tokens_free{{{large_labels}}}"] == info.kv_budget_tokens - info.kv_tokens
    assert f"backoff_kv_tokens_used{{{small_labels},model=small}}" in values
    assert "backoff_large_sessions_total" not in declared and "backoff_large_sessions" in declared
    # every sample names the replica it came from (as Ray's export does)
    assert all('replica="' in line for line in reply.text.splitlines() if line and not line.startswith("#"))


def _documented() -> set[str]:
    """The series docs/serving.md's metrics table lists."""
    text = (ROOT / "docs" / "serving.md").read_text()
    return set(re.findall(r"^\| `(backoff_[a-z0-9_]+)`", text, re.M))


def test_every_documented_series_is_served_and_every_served_one_documented(served):
    _, _, declared = _scrape(served[0])
    documented = _documented()
    assert len(documented) >= 20
    assert documented == declared, (documented - declared, declared - documented)


def test_the_grafana_dashboard_queries_only_served_series(served):
    _, _, declared = _scrape(served[0])
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    servable = declared | {f"{n}_{part}" for n in declared for part in ("bucket", "sum", "count")}
    for expr in exprs:
        names = set(re.findall(r"\bbackoff_[a-z0-9_]+", expr))
        assert names and names <= servable, (expr, names - servable)
    queried = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"\bbackoff_[a-z0-9_]+", e)}
    assert {"backoff_tokens_total", "backoff_requests_total", "backoff_request_latency_s"} <= queried


def test_a_larger_replica_that_fails_leaves_the_small_models_series(served, monkeypatch):
    base, _, large, _ = served

    async def broken():
        raise RuntimeError("replica gone")

    monkeypatch.setattr(large, "metric_series", broken)
    _, values, _ = _scrape(base)
    assert values["backoff_requests_total{deployment=test,outcome=finished}"] == N
    assert not any(k.startswith("backoff_large_") for k in values)
