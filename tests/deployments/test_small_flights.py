"""Catch-ups in flight (`overlap_catch_ups`) through the deployments' user classes with Ray not
started (tests/support/serve_fakes.py: the Ingress behind a real HTTP server, a SmallModel and
a LargeModel behind a fake DeploymentHandle) and the real HTTP client: the SmallModel's engine
sends M_L's batched catch-ups to the LargeModel replica from a worker thread while its step
loop goes on, and concurrent sampled requests get the in-process synchronous engine's tokens
and sources. The same classes run under Serve in test_app_*.py."""

from __future__ import annotations

import asyncio

from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams
from clients.http_client import AsyncBackoffHTTPClient
from deployments import ingress
from tests.support.helpers import engine_for
from tests.support.serve_fakes import FakeHandle, LoopThread, ingress_replica, large_replica, serving, small_replica

ARGS = {"overlap_catch_ups": True, "catch_up_wait_ms": 0}


def test_concurrent_sampled_requests_in_flight_match_the_synchronous_engine(monkeypatch, pair, tokenizer):
    prompts = [[3 + i, 4 + i, 5] for i in range(8)]
    lt = LoopThread()
    large = large_replica(monkeypatch, pair[1])
    small = small_replica(monkeypatch, pair[0], tokenizer, [FakeHandle([large], lt)], ARGS)
    ingress_replica(monkeypatch, small)

    async def run(base: str):
        async with AsyncBackoffHTTPClient(base) as http:
            return await asyncio.gather(
                *[
                    http.complete(
                        p,
                        max_tokens=16,
                        temperature=1.0,
                        ignore_eos=True,
                        seed=i,
                        router="random",
                        backoff_threshold=0.5,
                    )
                    for i, p in enumerate(prompts)
                ]
            )

    try:
        with serving(ingress.app) as base:
            outs = asyncio.run(run(base))
        info = small.info()
    finally:
        small.loop.stop()
        large.batcher.shutdown()
        lt.stop()
    local = engine_for(pair, tokenizer, context_window=512, hidden_size=pair[0].config.hidden_size)
    assert not local.overlap_catch_ups
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = local.generate(
            GenerationRequest(
                tuple(p),
                SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=i),
                RoutingParams(router="random", thresholds=(0.5,)),
            )
        )
        assert (out.token_ids, out.sources) == (list(ref.token_ids), list(ref.sources))
    assert sum(out.sources.count(1) for out in outs) > 0  # M_L answered, from its own replica
    assert info.flights > 0 and info.live == 0  # its catch-ups flew; nothing is left in flight
