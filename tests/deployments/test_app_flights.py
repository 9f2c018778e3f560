"""Catch-ups in flight (`overlap_catch_ups`) over a real (local, CPU) Ray Serve app and the real
HTTP client: the SmallModel's engine sends M_L's batched catch-ups to the LargeModel replica
from a worker thread while its step loop goes on, and concurrent sampled requests get the
in-process synchronous engine's tokens and sources."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")
from ray import serve  # noqa: E402

from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams  # noqa: E402
from clients.http_client import AsyncBackoffHTTPClient  # noqa: E402
from tests.support.served_app import ServedApp, in_process_engine  # noqa: E402

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)


def _edit(config: dict, dirs) -> None:
    config["applications"][0]["args"].update(overlap_catch_ups=True, catch_up_wait_ms=0)


@pytest.fixture(scope="module")
def served(serve_app) -> ServedApp:
    return serve_app("flights", edit=_edit)


def test_concurrent_sampled_requests_in_flight_match_the_synchronous_engine(served):
    prompts = [[3 + i, 4 + i, 5] for i in range(8)]

    async def run():
        async with AsyncBackoffHTTPClient(served.url) as http:
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

    outs = asyncio.run(run())
    local = in_process_engine(served.model_dirs["small"], served.model_dirs["large"])
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
    info = serve.get_deployment_handle("SmallModel", "backoff").info.remote().result(timeout_s=30)
    assert info.flights > 0 and info.live == 0  # its catch-ups flew; nothing is left in flight
