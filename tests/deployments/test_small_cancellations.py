"""A thousand streams whose callers go away after the first token, through the deployments'
user classes with Ray not started (tests/support/serve_fakes.py: the Ingress behind a real
HTTP server, a SmallModel, two LargeModel replicas behind a fake DeploymentHandle): every
cancel reaches the step loop and frees the request's M_L session. M_L holds each stream's
session by then (always-large, catch-ups 25 ms slow, 200 tokens asked) and only the close
the cancel leads to can free it (the router is alive, so its lease holds). Half the streams
close their HTTP connection, half are our async client's tasks cancelled. The same ways,
and gRPC's, run through Serve's proxies in test_app_faults.py, a hundred and fifty of them."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from clients.http_client import AsyncBackoffHTTPClient
from deployments import ingress
from tests.support.serve_fakes import FakeHandle, LoopThread, ingress_replica, large_replica, serving, small_replica
from tests.support.served_app import sse_closed_at_first_token, stream_cancelled_at_first_token

STREAMS = 1000
FIELDS = {"max_tokens": 200, "temperature": 0, "ignore_eos": True, "router": "always-large"}
BODY = {"prompt": [4, 5, 6], **FIELDS}


@pytest.mark.slow  # ~30 s: a thousand streams over loopback HTTP
def test_a_thousand_cancelled_streams_free_every_session(monkeypatch, pair, tokenizer):
    loop_thread = LoopThread()
    larges = [large_replica(monkeypatch, pair[1]) for _ in range(2)]
    for large in larges:
        large.reconfigure({"inject_delay_ms": 25.0})
    args = {"routing": {"router": "entropy"}, "limits": {"max_concurrent_per_client": None}}
    small = small_replica(monkeypatch, pair[0], tokenizer, [FakeHandle(larges, loop_thread)], args)
    ingress_replica(monkeypatch, small)
    gate = asyncio.Semaphore(48)

    async def until_admitted(way) -> int:
        async with gate:
            for refused in range(60):
                if await asyncio.wait_for(way(), 60):
                    return refused
                await asyncio.sleep(0.2)
        pytest.fail("a stream was refused for capacity 60 times in a row")

    async def main(base: str) -> dict[str, int]:
        async with (
            httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=64)) as http,
            AsyncBackoffHTTPClient(base) as client,
        ):
            ways = {
                "HTTP stream closed": lambda: sse_closed_at_first_token(http, {**BODY, "stream": True}),
                "client task cancelled": lambda: stream_cancelled_at_first_token(client, BODY["prompt"], **FIELDS),
            }
            cancelled = {}
            for name, way in ways.items():
                before = small.info().cancelled
                await asyncio.gather(*[until_admitted(way) for _ in range(STREAMS // len(ways))])
                deadline = time.monotonic() + 60
                while small.info().live or any(large.info().sessions for large in larges):
                    assert time.monotonic() < deadline, f"{name}: sessions left {[la.info().sessions for la in larges]}"
                    await asyncio.sleep(0.05)
                cancelled[name] = small.info().cancelled - before
            return cancelled

    try:
        with serving(ingress.app) as base:
            cancelled = asyncio.run(main(base))
    finally:
        small.loop.stop()
        for large in larges:
            large.batcher.shutdown()
        loop_thread.stop()
    for count in cancelled.values():  # the rest ran to their 200 tokens before the cancel came
        assert count >= 0.95 * STREAMS // 2, cancelled
    assert all(large.info().calls for large in larges)  # both replicas held sessions
