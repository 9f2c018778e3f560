"""The SmallModel deployment's own decisions, with Ray not started: its user class over a
tiny M_S and a LargeModel user class behind a fake DeploymentHandle (tests.support.serve_fakes).
Admission and refusal (Overloaded when full), live routing config reaching new requests,
prompt limits, lease renewals, freeing on a caller that went away. The step loop itself is
tested in tests/deployments/serving/test_engine_loop.py; the deployment under Serve in test_app*.py."""

from __future__ import annotations

import asyncio

import pytest

from backoff_core.types import GenerationResult, SamplingParams, TokenEvent
from deployments.serving.admission import Overloaded
from deployments.serving.outcomes import Admitted, Rejected
from deployments.serving.requests import RoutingOverrides, ServeRequest
from tests.support.serve_fakes import FakeHandle, LoopThread, large_replica, small_replica
from tests.support.served_app import wait_until
from tests.support.tiny import tiny_model


@pytest.fixture(scope="module")
def models():
    return tiny_model(1, sharpness=30), tiny_model(2, hidden=64, layers=4, sharpness=30)


@pytest.fixture
def chain(monkeypatch, models, tokenizer):
    """make(args) -> a SmallModel over one LargeModel replica; everything stopped afterwards."""
    lt, made = LoopThread(), []

    def make(args: dict | None = None):
        large = large_replica(monkeypatch, models[1])
        handle = FakeHandle([large], lt)
        small = small_replica(monkeypatch, models[0], tokenizer, [handle], args)
        made.append((small, large))
        return small, large, handle

    yield make
    for small, large in made:
        small.loop.stop()
        large.batcher.shutdown()
    lt.stop()


def _request(request_id: str, prompt=(3, 4, 5), max_tokens: int = 6, **overrides) -> ServeRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return ServeRequest(request_id, sampling, RoutingOverrides(**overrides), prompt_ids=tuple(prompt))


async def _collect(small, request: ServeRequest) -> list:
    return [item async for item in small.generate(request)]


def _tokens(items: list) -> list[int]:
    flat = []
    for item in items:
        flat += [e.token_id for e in (item if isinstance(item, tuple) else (item,)) if isinstance(e, TokenEvent)]
    return flat


def test_a_chain_needs_one_handle_per_larger_level(monkeypatch, models, tokenizer):
    with pytest.raises(ValueError, match="needs 1 larger deployments, got 0"):
        small_replica(monkeypatch, models[0], tokenizer, [])


def test_a_request_streams_admitted_tokens_result_and_renews_the_lease(chain):
    small, large, handle = chain({"routing": {"router": "always-large"}})
    items = asyncio.run(_collect(small, _request("r1")))
    assert isinstance(items[0], Admitted) and items[0].request_id == "r1" and items[0].prompt_tokens == 3
    result = items[-1]
    assert isinstance(result, GenerationResult) and _tokens(items[1:-1]) == list(result.token_ids)
    assert len(result.token_ids) == 6 and result.backoff_rate == 0.0
    assert ("renew", ("small-replica-0",)) in handle.broadcasts  # this replica's lease on the larger replicas
    assert {name for name, _, _ in handle.sent} == {"extend", "close"}  # the session is freed on finish
    # the close is sent without waiting for it (as to Serve): it runs on the larger replica soon after
    wait_until(lambda: large.runner.request_ids() == [], "the larger replica closed the session", timeout_s=10)


def test_a_full_replica_refuses_with_overloaded_then_admits_again(chain):
    small, _, _ = chain({"admission": {"max_live_requests": 1, "max_waiting_requests": 0, "retry_after_s": 7.0}})

    async def main():
        first = small.generate(_request("long", max_tokens=400))
        assert isinstance(await anext(first), Admitted)  # holds the only slot
        refused = await _collect(small, _request("refused"))
        await first.aclose()  # the caller went away: its slot and sessions are freed
        again = await _collect(small, _request("again"))
        return refused, again

    refused, again = asyncio.run(main())
    assert len(refused) == 1 and isinstance(refused[0], Overloaded)
    assert refused[0].retry_after_s == 7.0 and "capacity" in refused[0].message
    assert isinstance(again[0], Admitted) and isinstance(again[-1], GenerationResult)
    info = small.info()
    assert (info.cancelled, info.admitted, info.live) == (1, 0, 0)


def test_reconfigure_reaches_new_requests(chain):
    small, _, handle = chain({"routing": {"router": "entropy", "thresholds": [99.0]}})
    stays_small = asyncio.run(_collect(small, _request("a")))[-1]
    assert stays_small.backoff_rate == 1.0 and not handle.sent  # nothing reached M_L
    small.reconfigure({"router": "entropy", "thresholds": [0.0], "large_timeout_s": 4.0})  # entropy >= 0: always large
    all_large = asyncio.run(_collect(small, _request("b")))[-1]
    assert all_large.backoff_rate == 0.0 and handle.sent
    assert small.remotes[0].timeout_s == 4.0 and small.info().policy.thresholds == [0.0]
    small.reconfigure({"router": "always-small"})
    assert asyncio.run(_collect(small, _request("c")))[-1].backoff_rate == 1.0


def test_a_request_s_own_routing_overrides_the_config(chain):
    small, _, _ = chain({"routing": {"router": "always-small"}})
    result = asyncio.run(_collect(small, _request("a", router="always-large")))[-1]
    assert result.backoff_rate == 0.0


def test_published_thresholds_are_the_config_s_else_the_router_s_defaults(chain):
    small, _, _ = chain()
    published = []
    small.metrics.thresholds = published.append
    small.reconfigure({"router": "entropy", "thresholds": [1.5]})
    small.reconfigure({"router": "random", "rate": 0.3})
    small.reconfigure({"router": "no-such-router"})
    assert published[0] == [1.5] and len(published[1]) == 1 and published[2] == []


def test_prompts_over_the_token_limit_are_rejected(chain):
    small, _, _ = chain({"limits": {"max_prompt_tokens": 2}})
    items = asyncio.run(_collect(small, _request("long", prompt=(3, 4, 5))))
    assert len(items) == 1 and isinstance(items[0], Rejected) and "max_prompt_tokens" in items[0].message
    assert isinstance(asyncio.run(_collect(small, _request("short", prompt=(3, 4))))[-1], GenerationResult)


def test_launch_ahead_serves_the_same_tokens_where_m_s_has_static_kv_and_stays_off_elsewhere(chain, caplog):
    """`launch_ahead: true` (engine/ahead.py): over static KV (forced on the CPU here), M_S's
    steps are launched ahead and a sampled, randomly routed request streams the tokens it
    streams without (auto, the default: off on the CPU), info() counting the rows launched and
    taken; over per-session caches (the CPU's default) it stays off, with a warning."""
    static = {"models": {"static_kv": True, "kv_budget_tokens": 16 * 64, "kv_max_len": 64}}
    routing = {"router": "random", "thresholds": [0.5]}
    request = ServeRequest(
        "r",
        SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True),
        RoutingOverrides(),
        prompt_ids=(3, 4, 5),
    )
    auto = chain({**static, "routing": routing})[0]
    assert not auto.loop.engine.launch_ahead
    want = asyncio.run(_collect(auto, request))[-1]
    small, _, _ = chain({**static, "routing": routing, "launch_ahead": True})
    assert small.loop.engine.launch_ahead
    got = asyncio.run(_collect(small, request))[-1]
    assert (got.token_ids, got.sources) == (want.token_ids, want.sources) and 0 < got.backoff_rate < 1
    launched, used = small.info().launched_ahead
    assert 0 < used <= launched and auto.info().launched_ahead is None
    with caplog.at_level("WARNING", logger="backoff_core.engine.ahead"):
        plain, _, _ = chain({"routing": routing, "launch_ahead": True})
    assert not plain.loop.engine.launch_ahead and "not launched ahead" in caplog.text
