"""Serve's direct ingress (`backoff serve --direct-ingress`) over a real local Ray Serve app
and the real clients. The Ingress replica's own ports (the proxy's + 1, or the next free one)
must answer as the proxy's do: every token of the stand-in engine's script
(benchmarks/standin.py) once, in order, over HTTP/SSE and gRPC; a bad request a 400 with its
OpenAI body or INVALID_ARGUMENT; a client that goes away cancels its request in the step
loop. The proxy's ports keep working beside them.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from benchmarks.standin import expected_stream  # noqa: E402
from clients.grpc_client import AsyncBackoffGrpcClient  # noqa: E402
from clients.http_client import AsyncBackoffHTTPClient  # noqa: E402
from clients.wire import backoff_pb2 as pb  # noqa: E402
from clients.wire import backoff_pb2_grpc as pb_grpc  # noqa: E402
from deployments import harness  # noqa: E402
from deployments.serve_cli import DIRECT_PORTS  # noqa: E402
from tests.support.served_app import ServedApp, sse_then_disconnect  # noqa: E402

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)
PROMPT = [3, 7, 11]
DRAIN = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


def _standin(config: dict, dirs) -> None:
    config["applications"][0]["args"]["engine_factory"] = "benchmarks.standin:engine_2ms"


@pytest.fixture(scope="module")
def served(serve_app) -> ServedApp:
    # benchmarks.standin: LOCAL_ENV; Serve's shutdown waits out the replica's draining
    # period (30 s by default, the module's teardown: nothing is left to drain by then)
    return serve_app("direct", edit=_standin, direct_ingress=True, env=DRAIN)


@pytest.fixture(scope="module")
def direct(served) -> dict[str, str]:
    """The Ingress replica's own endpoints, as the controller publishes them."""
    return harness.wait_for_direct_endpoints("backoff")


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_the_replica_serves_on_the_ports_after_the_proxys(served, direct):
    """The first free port of its range: the proxy's + 1 unless another process holds that
    (one run found it taken and got + 2), at most DIRECT_PORTS further."""
    for replica, proxy in ((direct["http"], served.url), (direct["grpc"], served.grpc_target)):
        assert _port(proxy) < _port(replica) <= _port(proxy) + 1 + DIRECT_PORTS, (replica, proxy)


def test_direct_and_proxied_streams_carry_the_same_tokens(served, direct):
    n = 40

    async def stream(make) -> list[tuple]:
        async with make() as client:
            return [
                (d.token_id, d.source, d.text)
                async for d in client.stream(PROMPT, max_tokens=n, seed=4, ignore_eos=True)
                if d.token_id is not None
            ]

    clients = {
        "direct http": lambda: AsyncBackoffHTTPClient(direct["http"]),
        "direct grpc": lambda: AsyncBackoffGrpcClient(direct["grpc"]),
        "proxy http": lambda: AsyncBackoffHTTPClient(served.url),
        "proxy grpc": lambda: AsyncBackoffGrpcClient(served.grpc_target),
    }
    for name, make in clients.items():
        assert asyncio.run(stream(make)) == expected_stream(4, n), name


def test_a_bad_request_is_a_client_error_on_the_direct_ports(direct):
    response = httpx.post(f"{direct['http']}/v1/completions", json={"prompt": PROMPT, "max_tokens": -1}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    with grpc.insecure_channel(direct["grpc"]) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.BackoffStub(channel).Generate(pb.GenerateRequest(prompt_ids=PROMPT, top_p=2.0), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in caught.value.details()


def test_a_client_gone_from_a_direct_stream_leaves_the_step_loop(direct):
    router = serve.get_deployment_handle("SmallModel", "backoff")
    before = router.info.remote().result(timeout_s=30).cancelled

    body = {"prompt": PROMPT, "max_tokens": 4000, "seed": 7, "ignore_eos": True, "stream": True}  # 8 s
    assert asyncio.run(sse_then_disconnect(direct["http"], body)) == 2
    deadline = time.monotonic() + 6  # well before the stream would have ended
    while (info := router.info.remote().result(timeout_s=30)).live or info.admitted:
        assert time.monotonic() < deadline, f"the abandoned stream is still in the step loop: {info}"
        time.sleep(0.2)
    assert info.cancelled == before + 1
