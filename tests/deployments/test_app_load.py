"""Load, live reload and backpressure on a real (local, CPU) Ray Serve app with tiny models.

The end-to-end modules' app (tests/support/e2e_app.py, SHARED_APP: deployed by
test_app_e2e.py, which runs first; test_app_e2e_live.py runs next), deployed the way
`backoff serve` deploys it (the packaged config with overrides). Both of its applications:
`backoff` with the default limits (Ingress, one SmallModel, two LargeModel replicas, entropy
at e2e_app.THRESHOLD) and the chain of three (/chain) whose limits are tiny: 2 live + 1
waiting requests per SmallModel replica, 4 ongoing and 2 queued in Serve (the full app
here). The reload test changes the live config, so it runs last, and deploys the config as
it found it after.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import grpc
import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from clients import Retry  # noqa: E402
from clients.grpc_client import AsyncBackoffGrpcClient, BackoffGrpcClient  # noqa: E402
from clients.http_client import AsyncBackoffHTTPClient, BackoffHTTPClient  # noqa: E402
from clients.wire import backoff_pb2 as pb  # noqa: E402
from clients.wire import backoff_pb2_grpc as pb_grpc  # noqa: E402
from deployments import harness  # noqa: E402
from tests.support import e2e_app  # noqa: E402
from tests.support.served_app import ServedApp, deploy, deployment_config, wait_until  # noqa: E402

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)
SHARED_APP = e2e_app.SHARED_KEY  # the app of test_app_e2e*.py and this module, deployed once
FULL = "chain"  # the application with tiny limits (e2e_app.edit_with_chain), at /chain
ALL_SMALL = 50.0  # nothing is that uncertain: every token from M_S (`backoff`: entropy at 0.4)


@pytest.fixture(scope="module")
def served(shared_app) -> ServedApp:
    return shared_app(SHARED_APP, e2e_app.start_with_chain)


def _info(deployment: str, app: str = "backoff"):
    return serve.get_deployment_handle(deployment, app).info.remote().result(timeout_s=30)


def _replica_pids(app: str = "backoff") -> dict[str, int]:
    """replica id -> pid of every replica of the app (keyed calls spread over LargeModels)."""
    pids = {i.replica: i.pid for i in (_info("Ingress", app), _info("SmallModel", app))}
    large = serve.get_deployment_handle("LargeModel", app)
    for k in range(24):
        info = large.options(multiplexed_model_id=f"probe-{k}").info.remote().result(timeout_s=30)
        pids[info.replica] = info.pid
    return pids


def _wait_idle(app: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (info := _info("SmallModel", app)).admitted or info.live:
        assert time.monotonic() < deadline, f"{app}: requests still held: {info}"
        time.sleep(0.2)


# -- backpressure ----------------------------------------------------------------------------


async def _http_burst(url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def one(i: int) -> httpx.Response:
            body = {
                "prompt": [3 + i, 7, 11],
                "max_tokens": 64,
                "temperature": 0,
                "ignore_eos": True,
                "stream": i % 2 == 1,
            }
            response = await http.post("/v1/completions", json=body)
            await response.aread()
            return response

        return await asyncio.gather(*[one(i) for i in range(n)])


async def _grpc_burst(target: str, n: int) -> list[tuple[grpc.StatusCode, dict, str]]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.BackoffStub(channel)

        async def one(i: int) -> tuple[grpc.StatusCode, dict, str]:
            request = pb.GenerateRequest(prompt_ids=[5 + i, 7], max_tokens=64, temperature=0, ignore_eos=True)
            metadata = (("application", FULL),)
            try:
                if i % 2:
                    [c async for c in stub.GenerateStream(request, metadata=metadata)]
                else:
                    await stub.Generate(request, metadata=metadata)
                return grpc.StatusCode.OK, {}, ""
            except grpc.aio.AioRpcError as err:
                kind = "stream" if i % 2 else "unary"
                return err.code(), dict(err.trailing_metadata() or ()), f"{kind}: {err.details()}"

        return await asyncio.gather(*[one(i) for i in range(n)])


def test_a_full_app_refuses_with_503_and_retry_after_then_recovers(served):
    full = f"{served.url}/{FULL}"

    async def burst():
        return await asyncio.gather(_http_burst(full, 24), _grpc_burst(served.grpc_target, 8))

    responses, rpcs = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes  # no other 5xx, nothing hangs
    refused = [r for r in responses if r.status_code == 503]
    assert refused, codes
    assert 200 in codes or grpc.StatusCode.OK in [code for code, _, _ in rpcs]  # which transport won varies
    for r in refused:
        assert r.headers["retry-after"] == f"{e2e_app.CHAIN_RETRY_AFTER_S:g}"
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "overloaded"
    for r in responses:
        if r.status_code == 200 and r.headers["content-type"].startswith("application/json"):
            assert r.json()["usage"]["completion_tokens"] == 64
        elif r.status_code == 200:
            assert r.text.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in r.text
    assert {code for code, _, _ in rpcs} <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, [
        (code, why) for code, _, why in rpcs
    ]
    assert any(code == grpc.StatusCode.RESOURCE_EXHAUSTED for code, _, _ in rpcs)
    for code, trailing, why in rpcs:
        # Serve's gRPC proxy keeps a streaming method's trailing metadata only with a message
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and why.startswith("unary"):
            assert trailing.get("retry-after") == f"{e2e_app.CHAIN_RETRY_AFTER_S:g}", trailing
    # both bounds refused: the SmallModel's admission gate and Serve's queue in the Ingress
    messages = [r.json()["error"]["message"] for r in refused] + [why for _, _, why in rpcs]
    assert any("the server is at capacity" in m for m in messages), messages
    assert any("Request dropped due to backpressure" in m for m in messages), messages

    _wait_idle(FULL)  # every slot was given back
    with BackoffHTTPClient(full) as http, BackoffGrpcClient(served.grpc_target, application=FULL) as rpc:
        for client in (http, rpc):
            assert len(client.complete([3, 4], max_tokens=8, ignore_eos=True).token_ids) == 8

    async def patient():  # a client that retries gets through a burst, bounded
        retry = Retry(attempts=40, max_wait_s=0.25)
        async with AsyncBackoffHTTPClient(full, retry=retry) as client:
            return await asyncio.gather(
                *[client.complete([3 + i, 4], max_tokens=16, ignore_eos=True) for i in range(10)]
            )

    assert all(len(out.token_ids) == 16 for out in asyncio.run(patient()))


# -- load through a live reload (changes the config: runs last) --------------------------------

STREAMS, GRPC_STREAMS = 32, 4


@dataclass(frozen=True)
class Record:
    start: float  # time.monotonic() when the client sent the request
    end: float
    backoff_rate: float | None  # None: failed
    error: str = ""


async def _stream_loop(i: int, served: ServedApp, records: list[Record], stop: threading.Event) -> None:
    """One of the concurrent streams: requests back to back until `stop`."""
    if i < GRPC_STREAMS:
        client = AsyncBackoffGrpcClient(served.grpc_target, application="backoff", timeout=120)
    else:
        client = AsyncBackoffHTTPClient(served.url, timeout=120)
    n = 0
    async with client:
        while not stop.is_set():
            start = time.monotonic()
            try:
                deltas = [
                    d
                    async for d in client.stream([3 + i, 7, 11 + n % 20], max_tokens=24, temperature=0, ignore_eos=True)
                ]
                usage = deltas[-1].usage
                assert usage.completion_tokens == 24, usage
                records.append(Record(start, time.monotonic(), usage.backoff_rate))
            except Exception as exc:  # noqa: BLE001 - every failure is recorded and asserted on
                records.append(Record(start, time.monotonic(), None, f"{type(exc).__name__}: {exc}"))
            n += 1


def _load(served: ServedApp, records: list[Record], stop: threading.Event) -> threading.Thread:
    async def run():
        await asyncio.gather(*[_stream_loop(i, served, records, stop) for i in range(STREAMS)])

    thread = threading.Thread(target=asyncio.run, args=(run(),), name="load", daemon=True)
    thread.start()
    return thread


def _most_at_once(records: list[Record]) -> int:
    """The most requests in flight at one time (client side)."""
    edges = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_32_streams_through_a_live_threshold_change(served):
    pids = _replica_pids()
    records: list[Record] = []
    stop = threading.Event()
    load = _load(served, records, stop)
    try:
        wait_until(lambda: len(records) >= 2 * STREAMS, "the load did not start", 120.0)
        edited = json.loads(json.dumps(served.config))
        deployment_config(edited, "SmallModel")["user_config"]["threshold"] = [ALL_SMALL]
        deployed = time.monotonic()
        deploy(edited, served.config_path.with_name("edited.yaml"))
        applied = wait_until(
            lambda: _info("SmallModel").policy.thresholds == [ALL_SMALL], "reconfigure did not arrive", 120.0
        )
        wait_until(
            lambda: sum(r.start > applied for r in records) >= 2 * STREAMS, "no requests after the deploy", 120.0
        )
    finally:
        stop.set()
        load.join(timeout=120)
    assert not load.is_alive()

    failed = [r.error for r in records if r.backoff_rate is None]
    assert not failed, failed[:5]
    before = [r for r in records if r.end < deployed]
    across = [r for r in records if r.start < applied and r.end > deployed]
    after = [r for r in records if r.start > applied]
    assert before and across and after, (len(before), len(across), len(after))
    assert _most_at_once(records) == STREAMS
    assert sum(r.backoff_rate for r in before) / len(before) < 0.9  # the old threshold: both sources
    assert all(r.backoff_rate == 1.0 for r in after)  # the new one, for every request admitted since
    assert _replica_pids() == pids  # no replica was restarted
    harness.wait_until_running("backoff")
    _wait_idle("backoff")
    deploy(served.config, served.config_path.with_name("restored.yaml"))  # as test_app_e2e_live.py expects it
    wait_until(lambda: _info("SmallModel").policy.thresholds == [e2e_app.THRESHOLD], "the threshold restored", 120.0)
