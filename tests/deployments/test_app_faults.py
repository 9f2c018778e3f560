"""Faults on the real Serve application (local CPU Ray, loopback, tiny models).

One application for the module: Ingress, TWO SmallModel replicas (one can die while the
other serves), TWO LargeModel replicas. Leases are short (lease_s = 3) and every catch-up
is delayed (inject_delay_ms = 100) so a long request lasts long enough to kill
something under it on any machine. In order: 150 cancelled streams (a thousand run through
the same classes without Ray in test_small_cancellations.py), a LargeModel replica
killed under a gRPC stream, a SmallModel replica killed under several requests, a slow M_L
(live config) that degrades or fails requests, then recovers, and last the Ingress replica
killed under gRPC and HTTP calls (Serve's proxies answer them in words for the client).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from dataclasses import dataclass

import grpc
import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams  # noqa: E402
from clients import TransportError  # noqa: E402
from clients.grpc_client import AsyncBackoffGrpcClient, BackoffGrpcClient  # noqa: E402
from clients.http_client import AsyncBackoffHTTPClient, BackoffHTTPClient  # noqa: E402
from clients.wire import backoff_pb2 as pb  # noqa: E402
from clients.wire import backoff_pb2_grpc as pb_grpc  # noqa: E402
from deployments import harness  # noqa: E402
from tests.support.served_app import (  # noqa: E402
    ServedApp,
    deploy,
    deployment_config,
    in_process_engine,
    sse_closed_at_first_token,
    stream_cancelled_at_first_token,
    stream_noting_first,
)

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)
APP = "backoff"
METADATA = (("application", APP),)
LEASE_S = 3.0
# per catch-up: a long request lasts while its steps cost little CPU (LONG, always-large: >= 15 s
# in 150 steps; it was 400 steps at 25 ms: 10 s)
DELAY_MS = 100.0
LONG = dict(max_tokens=150, temperature=0, ignore_eos=True, router="always-large")
PROMPT = [4, 5, 6]


class Refused(Exception):
    """The server had no room for a request (503 / RESOURCE_EXHAUSTED): send it again later."""


def _edit(config: dict, dirs) -> None:
    # one test client opens hundreds of streams; the per-client cap is tests/deployments/test_app_input_access.py's
    config["applications"][0]["args"]["limits"] = {"max_concurrent_per_client": None}
    deployment_config(config, "SmallModel")["user_config"] = {
        "router": "entropy",
        "threshold": [0.4],
        "large_timeout_s": 10.0,
    }
    deployment_config(config, "LargeModel")["user_config"].update(lease_s=LEASE_S, inject_delay_ms=DELAY_MS)


@pytest.fixture(scope="module")
def served(serve_app) -> ServedApp:
    return serve_app("faults", replicas={"small": 2, "large": 2}, edit=_edit)


@pytest.fixture(scope="module")
def reference(served):
    """The in-process engine's tokens for PROMPT under LONG (always-large, greedy)."""
    engine = in_process_engine(served.model_dirs["small"], served.model_dirs["large"])
    result = engine.generate(
        GenerationRequest(
            tuple(PROMPT),
            SamplingParams(max_tokens=LONG["max_tokens"], ignore_eos=True),
            RoutingParams(router="always-large"),
        )
    )
    return list(result.token_ids)


# -- probes -----------------------------------------------------------------------------------


async def _infos(deployment: str) -> dict:
    """info() of every live replica of a deployment, by replica id (Serve's broadcast)."""
    handle = serve.get_deployment_handle(deployment, APP)
    infos = await handle.broadcast("info").results_async(timeout_s=30, return_exceptions=True)
    return {i.replica: i for i in infos if not isinstance(i, BaseException)}


async def _large_infos() -> dict:
    return await _infos("LargeModel")


async def _router_infos() -> dict:
    return await _infos("SmallModel")


async def _poll(check, timeout_s: float, what: str) -> float:
    """Seconds until `await check()` is true."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.2)
    return time.monotonic() - start


async def _all_freed() -> bool:
    routers, larges = await _router_infos(), await _large_infos()
    return all(r.live == 0 for r in routers.values()) and not any(i.sessions for i in larges.values())


def _settled() -> None:
    """Wait until no request of an earlier test is live (a test that failed may leave some)."""
    asyncio.run(_poll(_all_freed, 300, "requests left by an earlier test"))


def _deploy(served: ServedApp, router: dict | None = None, large: dict | None = None) -> None:
    """`backoff serve --config edited.yaml` with these user_config changes (live: no restart)."""
    for d in served.config["applications"][0]["deployments"]:
        if change := {"SmallModel": router, "LargeModel": large}.get(d["name"]):
            d["user_config"].update(change)
    deploy(served.config, served.config_path.with_name("edited.yaml"))

    async def applied() -> bool:
        routers, larges = await _router_infos(), await _large_infos()
        return all(r.policy.model_dump().items() >= (router or {}).items() for r in routers.values()) and all(
            i.config.model_dump().items() >= (large or {}).items() for i in larges.values()
        )

    asyncio.run(_poll(applied, 60, "the live config"))
    harness.wait_until_running(APP)


# -- 3. cancellations free every session ---------------------------------------------------------

CANCEL_BODY = dict(prompt=PROMPT, max_tokens=50, temperature=0, ignore_eos=True, router="always-large")  # >= 5 s
GRPC_CANCEL_TOKENS = 15  # >= 1.5 s of catch-up delays: the cancel still arrives long before the end


async def _http_closed(http: httpx.AsyncClient) -> None:
    """An SSE stream whose connection is closed at the first token."""
    if not await sse_closed_at_first_token(http, {**CANCEL_BODY, "stream": True}):
        raise Refused


async def _client_cancelled(client: AsyncBackoffHTTPClient) -> None:
    """Our async client's stream, its task cancelled after the first token."""
    fields = {k: v for k, v in CANCEL_BODY.items() if k != "prompt"}
    if not await stream_cancelled_at_first_token(client, PROMPT, **fields):
        raise Refused


async def _grpc_cancelled(stub) -> None:
    """A gRPC stream cancelled after its first message."""
    call = stub.GenerateStream(
        pb.GenerateRequest(
            prompt_ids=PROMPT, max_tokens=GRPC_CANCEL_TOKENS, temperature=0, ignore_eos=True, router="always-large"
        ),
        metadata=METADATA,
    )
    try:
        await call.read()
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise Refused from None
        raise
    call.cancel()


async def _send_until_admitted(way, gate: asyncio.Semaphore) -> int:
    """One stream; sent again a second after a refusal for capacity, as a client should
    (streams whose cancel Ray's gRPC proxy missed can fill the routers); the refusals."""
    async with gate:
        for refused in range(60):
            try:
                await asyncio.wait_for(way(), 120)
                return refused
            except Refused:
                await asyncio.sleep(1.0)
        pytest.fail("a stream was refused for capacity 60 times in a row")


async def _cancelled_at_routers() -> int:
    return sum(r.cancelled for r in (await _router_infos()).values())


async def _cancel_streams(served: ServedApp, n: int) -> dict[str, tuple[int, int, float, float, int]]:
    """n streams, a third each way, one way after another. Per way: (streams, cancelled at
    the routers, seconds to send them, seconds until every M_L session was freed, refusals)."""
    report = {}
    gate = asyncio.Semaphore(48)
    async with (
        httpx.AsyncClient(base_url=served.url, timeout=120, limits=httpx.Limits(max_connections=64)) as http,
        AsyncBackoffHTTPClient(served.url) as client,
        grpc.aio.insecure_channel(served.grpc_target) as channel,
    ):
        stub = pb_grpc.BackoffStub(channel)
        ways = {
            "HTTP stream closed": lambda: _http_closed(http),
            "async client task cancelled": lambda: _client_cancelled(client),
            "gRPC stream cancelled": lambda: _grpc_cancelled(stub),
        }
        for k, (name, way) in enumerate(ways.items()):
            count, before = n // 3 + (k < n % 3), await _cancelled_at_routers()
            start = time.monotonic()
            refused = sum(await asyncio.gather(*[_send_until_admitted(way, gate) for _ in range(count)]))
            sent = time.monotonic() - start
            freed = await _poll(_all_freed, 300, f"sessions of {name} streams")
            report[name] = (count, await _cancelled_at_routers() - before, sent, freed, refused)
    return report


def test_cancelled_streams_through_serves_proxies_leave_no_session(served):
    """Three ways a caller goes away after the first token, a third of the streams each.
    M_L holds each stream's session by then (always-large) and only its close can free it
    (the routers live, so their lease holds; the TTL is 600 s). Ray Serve 2.60's gRPC proxy
    misses a cancel that arrives while it writes a chunk (its send_request_to_replica
    swallows the GeneratorExit): such a stream runs to max_tokens, then frees its session.
    Up to an eighth of them did so on a loaded 2-core machine, so the gRPC streams ask for
    fewer tokens (GRPC_CANCEL_TOKENS): the missed ones then end in seconds, not minutes.
    What this adds to test_small_cancellations.py's thousand (the Ingress and the step loop
    without Ray) is Serve's proxies and handles passing each cancel on: 50 streams a way."""
    n = 150
    report = asyncio.run(_cancel_streams(served, n))
    for name, (count, ended, sent, freed, refused) in report.items():
        print(
            f"\n{name}: {count} streams in {sent:.1f} s ({refused} refusals for capacity, sent again), {ended} "
            f"of them cancelled at the router; every M_L session freed {freed:.1f} s later",
            end="",
        )
    assert sum(count for count, *_ in report.values()) == n
    for name in ("HTTP stream closed", "async client task cancelled"):
        count, ended, *_ = report[name]
        assert ended >= 0.95 * count, report  # the rest finished (50 tokens) before their cancel arrived


# -- 1. a LargeModel replica dies under a gRPC stream -----------------------------------------------


def test_killed_large_replica_mid_grpc_stream_still_completes(served, reference):
    n = 100  # >= 10 s
    _settled()
    with BackoffGrpcClient(served.grpc_target, application=APP) as client:
        stream = client.stream(PROMPT, **{**LONG, "max_tokens": n})
        deltas = [next(stream) for _ in range(5)]
        holders = [i for i in asyncio.run(_large_infos()).values() if i.sessions]
        assert len(holders) == 1, holders
        os.kill(holders[0].pid, signal.SIGKILL)
        deltas += list(stream)
    tokens = [d.token_id for d in deltas if d.finish_reason is None]
    assert deltas[-1].finish_reason == "length" and tokens == reference[:n]  # re-prefilled elsewhere
    harness.wait_until_running(APP)


# -- 2. a SmallModel replica dies under several requests ---------------------------------------------


@dataclass
class Flight:
    kind: str  # http, grpc (streams) or unary (HTTP, not streamed)
    task: asyncio.Task
    request_id: str = ""
    router: str = ""  # SmallModel replica serving it


async def _unary(http: httpx.AsyncClient) -> httpx.Response:
    return await http.post("/v1/completions", json={"prompt": PROMPT, **LONG})


async def _launch(kind: str, clients: tuple, known: set[str]) -> Flight:
    """Start one request and find the router that serves it (from the routers' live ids)."""
    http, client, grpc_client = clients
    first: asyncio.Future = asyncio.get_running_loop().create_future()
    coro = {
        "http": lambda: stream_noting_first(client, first, PROMPT, **LONG),
        "grpc": lambda: stream_noting_first(grpc_client, first, PROMPT, **LONG),
        "unary": lambda: _unary(http),
    }[kind]()
    flight = Flight(kind, asyncio.create_task(coro))
    request_id = await asyncio.wait_for(first, 30) if kind != "unary" else ""
    for _ in range(200):
        routers = await _router_infos()
        where = {r: info.replica for info in routers.values() for r in info.requests}
        fresh = [r for r in where if r not in known and (not request_id or r == request_id)]
        assert len(fresh) <= 1, f"{kind} request: {len(fresh)} unknown requests on the routers ({fresh})"
        if fresh:
            flight.request_id, flight.router = fresh[0], where[fresh[0]]
            known.add(flight.request_id)
            return flight
        await asyncio.sleep(0.05)
    raise AssertionError(f"{kind} request not found on any router")


async def _flights_on_both_routers(clients: tuple) -> list[Flight]:
    """Requests until each router serves each kind (where one lands is Serve's choice)."""
    known: set[str] = set()
    flights: list[Flight] = []
    kinds = ["http", "grpc", "unary"]
    while len(flights) < 24:
        flights.append(await _launch(kinds[len(flights) % 3], clients, known))
        placed = {(f.kind, f.router) for f in flights}
        routers = {f.router for f in flights}
        if len(routers) == 2 and all((k, r) in placed for k in kinds for r in routers):
            break
    return flights


async def _kill_a_router_under(flights: list[Flight]) -> tuple[str, float, float]:
    """SIGKILL one router once every request holds its M_L session; (the router, seconds
    until its requests failed, seconds until their M_L sessions were freed)."""
    victim = sorted({f.router for f in flights})[0]
    doomed = [f for f in flights if f.router == victim]

    async def all_hold_sessions() -> bool:  # every request's M_L session exists
        return sum(len(i.sessions) for i in (await _large_infos()).values()) == len(flights)

    await _poll(all_hold_sessions, 60, "M_L sessions of the requests")
    assert all(not f.task.done() for f in flights), "a request ended before the kill"
    os.kill((await _router_infos())[victim].pid, signal.SIGKILL)
    killed = time.monotonic()

    async def orphans_freed() -> bool:
        larges = await _large_infos()
        keys = [k for i in larges.values() for k in i.sessions]
        owners = {o for i in larges.values() for o, _ in i.owners}
        return victim not in owners and not any(k.startswith(f.request_id + "#") for k in keys for f in doomed)

    freeing = asyncio.create_task(_poll(orphans_freed, LEASE_S + 20, "sessions of the dead router"))
    await asyncio.gather(*[f.task for f in doomed], return_exceptions=True)
    failed_s = time.monotonic() - killed
    return victim, failed_s, await freeing


def _check_outcome(flight: Flight, out, victim: str, reference: list[int]) -> None:
    """A clear error per transport on the killed router; elsewhere the whole, right answer."""
    if flight.router == victim:
        if flight.kind == "unary":
            assert out.status_code == 503, out.text
            error = out.json()["error"]
            assert error["code"] == "router_unavailable" and "small router" in error["message"]
        else:
            assert isinstance(out, TransportError), (flight.kind, out)
            assert "small router" in out.message
            assert out.status == (503 if flight.kind == "http" else "UNAVAILABLE")
    else:
        assert not isinstance(out, BaseException), (flight.kind, out)
        if flight.kind == "unary":
            assert out.status_code == 200 and out.json()["choices"][0]["backoff"]["token_ids"] == reference
        else:
            assert [d.token_id for d in out if d.finish_reason is None] == reference
            assert out[-1].finish_reason == "length"


def test_killed_router_fails_its_requests_clearly_and_frees_their_sessions(served, reference):
    _settled()

    async def main():
        async with (
            httpx.AsyncClient(base_url=served.url, timeout=120) as http,
            AsyncBackoffHTTPClient(http=http) as client,
            AsyncBackoffGrpcClient(served.grpc_target, application=APP) as grpc_client,
        ):
            flights = await _flights_on_both_routers((http, client, grpc_client))
            victim, failed_s, freed_s = await _kill_a_router_under(flights)
            outcomes = await asyncio.gather(*[f.task for f in flights], return_exceptions=True)
            return flights, outcomes, victim, failed_s, freed_s

    flights, outcomes, victim, failed_s, freed_s = asyncio.run(main())
    print(
        f"\n{len(flights)} requests, {sum(f.router == victim for f in flights)} on the killed router: "
        f"they failed {failed_s:.1f} s after the kill, their M_L sessions were freed {freed_s:.1f} s after "
        f"it (lease_s = {LEASE_S}); the others finished"
    )
    for flight, out in zip(flights, outcomes):
        _check_outcome(flight, out, victim, reference)
    harness.wait_until_running(APP)
    asyncio.run(_poll(_all_freed, 60, "sessions after the kill"))


# -- 4. a slow M_L: degrade (or fail), then recover, all by live config ---------------------------


def test_slow_large_model_degrades_fails_and_recovers_live(served):
    prompt = [3, 7, 11]
    _settled()
    with BackoffHTTPClient(served.url) as client:
        healthy = client.complete(prompt, max_tokens=12, temperature=0, ignore_eos=True, router="always-large")
    assert not healthy.usage.degraded and healthy.usage.large_tokens == 12

    _deploy(served, router={"large_timeout_s": 0.5}, large={"inject_delay_ms": 3000.0})  # every call > 0.5 s
    with BackoffHTTPClient(served.url) as client, BackoffGrpcClient(served.grpc_target, application=APP) as rpc:
        start = time.monotonic()
        out = client.complete(prompt, max_tokens=12, temperature=0, ignore_eos=True, router="always-large")
        seconds = time.monotonic() - start
        deltas = list(rpc.stream(prompt, max_tokens=12, temperature=0, ignore_eos=True, router="always-large"))
        mixed = client.complete(prompt, max_tokens=12, temperature=0, ignore_eos=True)  # the live entropy router
    print(f"\ndegraded answer in {seconds:.2f} s (M_L delay 3 s per call, large_timeout_s 0.5)")
    assert seconds < 3.0  # not 12 x 3 s: one timeout, then M_S only
    assert out.usage.degraded and "no reply within 0.5 s" in out.usage.degraded_reason
    assert out.usage.large_tokens == 0 and out.sources == [0] * 12 and out.finish_reason == "length"
    assert deltas[-1].usage.degraded and all(d.source == 0 for d in deltas[:-1])
    assert mixed.usage.degraded and mixed.usage.large_tokens == 0

    _deploy(served, router={"on_large_failure": "fail"})
    with BackoffHTTPClient(served.url) as client:
        response = httpx.post(
            f"{served.url}/v1/completions",
            timeout=30,
            json={"prompt": prompt, "max_tokens": 12, "router": "always-large"},
        )
        assert response.status_code == 503 and response.json()["error"]["code"] == "large_unavailable"
        with pytest.raises(TransportError, match="no reply within"):
            list(client.stream(prompt, max_tokens=12, router="always-large"))
    with grpc.insecure_channel(served.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.BackoffStub(channel).Generate(
                pb.GenerateRequest(prompt_ids=prompt, max_tokens=12, router="always-large"), metadata=METADATA
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no reply within" in err.value.details()

    _deploy(served, router={"on_large_failure": "degrade", "large_timeout_s": 10.0}, large={"inject_delay_ms": 0.0})
    with BackoffHTTPClient(served.url) as client:
        again = client.complete(prompt, max_tokens=12, temperature=0, ignore_eos=True, router="always-large")
    assert not again.usage.degraded and again.usage.large_tokens == 12 and again.token_ids == healthy.token_ids
    # the calls that timed out landed late, after their close: tombstones, no session left
    asyncio.run(_poll(_all_freed, 60, "sessions after the slow period"))


# -- 5. the Ingress replica dies under calls: Serve's proxies answer, in words for the client ------

# what must never reach a client: Ray's exception names and reprs, actor ids, node addresses
INTERNAL_TEXT = re.compile(
    r"RayActorError|ActorID|Actor(Died|Unavailable)Error|[0-9a-f]{24,}|\d+\.\d+\.\d+\.\d+|<|\w+\("
)


def test_killed_ingress_under_grpc_and_http_calls_answers_without_internal_text(served):
    """Last (the app has one Ingress replica, which Serve then restarts). Ray 2.60's gRPC proxy
    puts str(RayActorError) (actor ids, the node's address) into INTERNAL's details
    (ray-project/ray#58851); deployments/proxy_errors.install_grpc words it for the client, naming the
    request id, and the HTTP proxy's empty 500 is a JSON error (proxy_errors.py)."""
    _settled()
    body = {**LONG, "max_tokens": 200}  # >= 5 s of catch-up delays: alive when the kill lands

    async def main():
        async with (
            httpx.AsyncClient(base_url=served.url, timeout=60) as http,
            grpc.aio.insecure_channel(served.grpc_target) as channel,
        ):
            stub = pb_grpc.BackoffStub(channel)
            request = pb.GenerateRequest(prompt_ids=PROMPT, **body)
            stream = stub.GenerateStream(request, metadata=(*METADATA, ("request_id", "kill-stream")))
            await stream.read()
            unary = asyncio.ensure_future(stub.Generate(request, metadata=(*METADATA, ("request_id", "kill-unary"))))
            posted = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": PROMPT, **body}))

            async def all_live() -> bool:
                return sum(r.live for r in (await _router_infos()).values()) == 3

            await _poll(all_live, 30, "the three calls at the routers")
            ingress = await serve.get_deployment_handle("Ingress", APP).info.remote()
            os.kill(ingress.pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                while await stream.read() != grpc.aio.EOF:
                    pass
            with pytest.raises(grpc.aio.AioRpcError) as answered:
                await unary
            return streamed.value, answered.value, await posted

    streamed, answered, posted = asyncio.run(main())
    for err, request_id in ((streamed, "kill-stream"), (answered, "kill-unary")):
        assert err.code() == grpc.StatusCode.INTERNAL, (err.code(), err.details())
        assert "replica handling this request was lost" in err.details() and f"(request {request_id}" in err.details()
        assert not INTERNAL_TEXT.search(err.details()), err.details()
    assert posted.status_code == 500, posted.text
    error = posted.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error", error
    assert not INTERNAL_TEXT.search(error["message"]), error["message"]
    harness.wait_until_running(APP)
