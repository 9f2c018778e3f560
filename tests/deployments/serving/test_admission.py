"""Backpressure without a cluster: the SmallModel's admission gate (live slots, a FIFO queue
with a timeout), the bounded-queue options of the config, the per-client limit's default, and the clients' OverloadedError and bounded retries (HTTP against a
mock transport, gRPC against an in-process server)."""

from __future__ import annotations

import asyncio
import json
from concurrent import futures

import grpc
import httpx
import pytest
from pydantic import ValidationError

from clients import OverloadedError, Retry, TransportError
from clients.grpc_client import AsyncBackoffGrpcClient, BackoffGrpcClient
from clients.http_client import AsyncBackoffHTTPClient, BackoffHTTPClient
from clients.wire import backoff_pb2 as pb
from clients.wire import backoff_pb2_grpc as pb_grpc
from clients.wire.errors import from_grpc, from_http
from deployments.serving.access import Edge
from deployments.serving.admission import AdmissionGate, Overloaded, live_slots, queue_depth
from deployments.serving.config import AppArgs, ReplicaConfig
from deployments.serving.edge_config import AccessConfig, AdmissionConfig, LimitsConfig

FAST = Retry(attempts=2, max_wait_s=0.01)  # retries honour Retry-After, capped here to keep tests fast


# -- admission gate ---------------------------------------------------------------------------


def test_gate_admits_live_then_queues_then_refuses_and_hands_slots_over_in_order():
    async def run():
        gate = AdmissionGate(max_live=2, max_waiting=2, retry_after_s=3.0)
        assert await gate.enter() is None and await gate.enter() is None  # two live
        order: list[int] = []

        async def waiter(i: int) -> None:
            assert await gate.enter() is None
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(2)]
        await asyncio.sleep(0)
        assert gate.waiting == 2 and gate.live == 2
        refused = await gate.enter()  # past the queue: refused at once, nothing held
        assert refused == Overloaded(refused.message, 3.0, "overloaded") and "2 live and 2 waiting" in refused.message
        assert gate.refused == 1 and gate.waiting == 2
        gate.leave()
        gate.leave()
        await asyncio.gather(*tasks)
        assert order == [0, 1] and gate.live == 2 and gate.waiting == 0
        gate.leave()
        gate.leave()
        assert gate.live == 0

    asyncio.run(run())


def test_a_waiter_past_the_timeout_is_refused_and_holds_nothing_and_one_served_in_time_is_not():
    async def run():
        gate = AdmissionGate(max_live=1, max_waiting=2, timeout_s=0.05, retry_after_s=2.0)
        assert await gate.enter() is None
        late = await gate.enter()  # no slot frees within 50 ms
        assert late.code == "queue_timeout" and late.retry_after_s == 2.0 and "0.05 s" in late.message
        assert (gate.timed_out, gate.waiting, gate.live) == (1, 0, 1)
        in_time = asyncio.create_task(gate.enter())
        await asyncio.sleep(0)
        gate.leave()  # its slot comes within the timeout: it is served
        assert await in_time is None and gate.live == 1 and gate.timed_out == 1
        gate.leave()
        assert gate.live == 0

    asyncio.run(run())


def test_a_slot_that_arrives_as_the_wait_runs_out_is_kept_not_lost():
    async def run():
        gate = AdmissionGate(max_live=1, max_waiting=1, timeout_s=0.05)
        assert await gate.enter() is None
        waiter = asyncio.create_task(gate.enter())
        await asyncio.sleep(0)
        asyncio.get_running_loop().call_later(0.05, gate.leave)  # the same moment as its timeout
        outcome = await waiter
        assert gate.waiting == 0
        # served, or timed out with the slot handed back: never a slot held by no one
        assert (outcome is None and gate.live == 1) or (outcome.code == "queue_timeout" and gate.live == 0)

    for _ in range(20):
        asyncio.run(run())


def test_a_cancelled_waiter_holds_no_slot():
    async def run():
        gate = AdmissionGate(max_live=1, max_waiting=1)
        assert await gate.enter() is None
        task = asyncio.create_task(gate.enter())
        await asyncio.sleep(0)
        task.cancel()  # the client went away while waiting
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.waiting == 0
        gate.leave()
        assert gate.live == 0 and await gate.enter() is None

    asyncio.run(run())


def test_a_waiter_cancelled_as_its_slot_arrives_passes_it_on():
    async def run():
        gate = AdmissionGate(max_live=1, max_waiting=2)
        assert await gate.enter() is None
        first = asyncio.create_task(gate.enter())
        second = asyncio.create_task(gate.enter())
        await asyncio.sleep(0)
        gate.leave()  # the slot goes to `first` ...
        first.cancel()  # ... which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await second is None and gate.live == 1

    asyncio.run(run())


def test_live_slots_follow_the_small_models_static_kv_and_the_queue_is_three_per_slot():
    assert live_slots(48, None) == 48  # per-session caches: no slots to count
    assert live_slots(48, 16) == 16 and live_slots(48, 64) == 48 and live_slots(48, 0) == 1
    assert queue_depth("auto", 48) == 3 * 48 and queue_depth("auto", 16) == 48 and queue_depth(5, 48) == 5


# -- config -----------------------------------------------------------------------------------


def test_admission_must_leave_room_below_the_serve_limit():
    args = AppArgs()  # the defaults are consistent: 48 live + 144 queued < 256
    assert args.admission.waiting_bound() == 144 and args.small.max_ongoing_requests == 256
    AppArgs(admission=AdmissionConfig(max_live_requests=63))  # 63 + 189 queued: 252 fits below 256 ...
    with pytest.raises(ValidationError, match="max_ongoing_requests"):
        AppArgs(admission=AdmissionConfig(max_live_requests=64))  # ... 64 + 192 does not
    with pytest.raises(ValidationError, match="max_ongoing_requests"):
        AppArgs(admission=AdmissionConfig(max_live_requests=200, max_waiting_requests=56))
    AppArgs(
        admission=AdmissionConfig(max_live_requests=2, max_waiting_requests=1),
        small=ReplicaConfig(max_ongoing_requests=4, max_queued_requests=2),
    )
    with pytest.raises(ValidationError, match="queue_timeout_s"):
        AdmissionConfig(queue_timeout_s=0)


def test_per_client_limit_is_off_without_api_keys_and_on_with_them():
    limits, admission = LimitsConfig(), AdmissionConfig()
    assert limits.max_concurrent_per_client == "auto"
    assert limits.per_client(False, admission) is None  # one client may be a whole load tool
    assert limits.per_client(True, admission) == 48 + 144  # one SmallModel replica's live slots and queue
    assert LimitsConfig(max_concurrent_per_client=5).per_client(False, admission) == 5
    assert LimitsConfig(max_concurrent_per_client=None).per_client(True, admission) is None
    keyed = Edge.from_config(AccessConfig(api_keys=["k"]), limits, AdmissionConfig(max_live_requests=2))
    assert keyed.slots.limit == 2 + 6 and Edge.from_config(AccessConfig(), limits).slots.limit is None


def test_queues_are_bounded_where_a_refusal_is_safe():
    from deployments.app import replica_options

    args = AppArgs()
    assert args.small.max_queued_requests and args.ingress.max_queued_requests
    assert args.large.max_queued_requests is None  # a refused catch-up would fail an admitted request
    small = replica_options(args.small, {}, retry_after_s=2.0)
    assert small["max_queued_requests"] == args.small.max_queued_requests
    assert small["backpressure_config"].retry_after_s == 2.0
    assert "max_queued_requests" not in replica_options(args.large, {})


# -- clients: one error type for "at capacity" --------------------------------------------------


class _Err(grpc.RpcError):
    def __init__(self, code, trailing=()):
        self._code, self._trailing = code, trailing

    def code(self):
        return self._code

    def details(self):
        return "full"

    def trailing_metadata(self):
        return self._trailing


def test_503_429_and_resource_exhausted_are_overloaded_errors():
    body = json.dumps(
        {"error": {"message": "at capacity", "type": "server_error", "param": None, "code": "overloaded"}}
    )
    err = from_http(503, body, "2")
    assert isinstance(err, OverloadedError) and isinstance(err, TransportError)
    assert (err.message, err.retry_after_s, err.status) == ("at capacity", 2.0, 503)
    assert isinstance(from_http(429, ""), OverloadedError) and from_http(503, "").retry_after_s is None
    assert not isinstance(from_http(502, ""), OverloadedError)
    err = from_grpc(_Err(grpc.StatusCode.RESOURCE_EXHAUSTED, (("retry-after", "3"),)))
    assert isinstance(err, OverloadedError) and err.retry_after_s == 3.0 and err.status == "RESOURCE_EXHAUSTED"
    assert not isinstance(from_grpc(_Err(grpc.StatusCode.UNAVAILABLE)), OverloadedError)


def test_retry_delays_are_bounded_and_only_for_overload():
    retry = Retry(attempts=2, max_wait_s=5.0, jitter=0.0)
    assert retry.delay(OverloadedError("x", retry_after_s=1.0), 0) == 1.0
    assert retry.delay(OverloadedError("x", retry_after_s=60.0), 1) == 5.0
    assert retry.delay(OverloadedError("x"), 1) == 1.0  # no Retry-After: 0.5 s, 1 s, ...
    assert retry.delay(OverloadedError("x"), 2) is None  # attempts used up
    assert retry.delay(TransportError("refused"), 0) is None


def _refusing(refusals: int):
    """A mock server that answers 503 + Retry-After `refusals` times, then serves."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if len(seen) <= refusals:
            body = {"error": {"message": "at capacity", "type": "server_error", "param": None, "code": "overloaded"}}
            return httpx.Response(503, json=body, headers={"Retry-After": "1"})
        if json.loads(request.content).get("stream"):
            usage = {
                "prompt_tokens": 1,
                "completion_tokens": 1,
                "total_tokens": 2,
                "small_tokens": 1,
                "large_tokens": 0,
                "large_calls": 0,
            }
            chunks = [
                {"id": "c", "choices": [{"text": "a", "backoff": {"token_id": 5, "source": 0, "index": 0}}]},
                {"id": "c", "choices": [{"text": "", "finish_reason": "length"}], "usage": usage},
            ]
            return httpx.Response(200, text="".join(f"data: {json.dumps(c)}\n\n" for c in chunks))
        return httpx.Response(200, json={"id": "c", "choices": [{"text": "a", "finish_reason": "length"}]})

    return handler, seen


def test_http_client_raises_overloaded_and_retries_when_asked():
    handler, seen = _refusing(refusals=5)
    with BackoffHTTPClient(http=httpx.Client(transport=httpx.MockTransport(handler), base_url="http://x")) as c:
        with pytest.raises(OverloadedError) as err:
            c.complete("hi")
        assert err.value.retry_after_s == 1.0 and len(seen) == 1  # no retry unless asked
    handler, seen = _refusing(refusals=2)
    http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://x")
    with BackoffHTTPClient(http=http, retry=FAST) as c:
        assert c.complete("hi").text == "a" and len(seen) == 3
    handler, seen = _refusing(refusals=3)  # one more refusal than attempts
    http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://x")
    with BackoffHTTPClient(http=http, retry=FAST) as c, pytest.raises(OverloadedError):
        list(c.stream("hi"))
    assert len(seen) == 3


def test_async_http_client_retries_a_refused_stream():
    handler, seen = _refusing(refusals=1)

    async def run():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x")
        async with AsyncBackoffHTTPClient(http=http, retry=FAST) as c:
            return [d async for d in c.stream("hi")]

    deltas = asyncio.run(run())
    assert [d.text for d in deltas] == ["a", ""] and len(seen) == 2


class _FullThenServing(pb_grpc.BackoffServicer):
    """RESOURCE_EXHAUSTED + retry-after for the first `refusals` calls, then serves."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.calls = refusals, 0

    def _refuse(self, context) -> bool:
        self.calls += 1
        if self.calls <= self.refusals:
            context.set_trailing_metadata((("retry-after", "1"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "at capacity")
        return False

    def Generate(self, request, context):
        self._refuse(context)
        return pb.GenerateResponse(id="g", text="ok", finish_reason="stop")

    def GenerateStream(self, request, context):
        self._refuse(context)
        yield pb.GenerateChunk(id="g", text="ok", token_id=1, source=0, index=0)
        yield pb.GenerateChunk(id="g", finish_reason="length", usage=pb.Usage(completion_tokens=1))


@pytest.fixture()
def grpc_full():
    service = _FullThenServing(refusals=2)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_BackoffServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", service
    server.stop(0)


def test_grpc_client_raises_overloaded_with_retry_after(grpc_full):
    target, service = grpc_full
    with BackoffGrpcClient(target) as client:
        with pytest.raises(OverloadedError) as err:
            client.complete("x")
        assert err.value.retry_after_s == 1.0
    with BackoffGrpcClient(target, retry=FAST) as client:
        assert client.complete("x").text == "ok" and service.calls == 3


def test_grpc_clients_retry_a_refused_stream(grpc_full):
    target, service = grpc_full

    async def run():
        async with AsyncBackoffGrpcClient(target, retry=FAST) as client:
            return [d async for d in client.stream("x")]

    assert "".join(d.text for d in asyncio.run(run())) == "ok" and service.calls == 3
    service.calls, service.refusals = 0, 1
    with BackoffGrpcClient(target, retry=FAST) as client:
        assert "".join(d.text for d in client.stream("x")) == "ok" and service.calls == 2
