"""Faults in the parts of deployments/ that run without a Ray cluster: session leases and
tombstones in the catch-up batcher, a slow large model behind RemoteLarge (the fake
transport of test_serve_units), and the Ingress's answer to a request the step loop failed
(its class called directly, with a fake router handle), unexpected errors in the OpenAI
shape (HTTP) or INTERNAL (gRPC), and the chaos knob that fails a request in the step loop.
Tiny models."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import httpx
import pytest
from fastapi import FastAPI

from backoff_core.errors import LargeUnavailable
from backoff_core.runners.dynamic import ModelRunner
from clients.wire import backoff_pb2 as pb
from clients.wire.types import GenerateParams
from deployments.http_errors import InternalErrors
from deployments.ingress import Ingress
from deployments.serving.access import Edge
from deployments.serving.batcher import CatchUpBatcher
from deployments.serving.catchup_wire import CatchUpCall
from deployments.serving.chaos import FaultInjector, InjectedFault
from deployments.serving.config import AppArgs
from deployments.serving.outcomes import Failed
from deployments.serving.readiness import Readiness
from deployments.streams import ServerFailure
from tests.support.helpers import engine_for, request
from tests.support.remote_fakes import FakeEndpoint, remote_engine


def test_sessions_of_an_owner_that_stops_renewing_are_freed(pair, loop_thread):
    runner = ModelRunner(pair[1], "large")
    batcher = CatchUpBatcher(runner)
    for key, owner in (("a1", "router-a"), ("a2", "router-a"), ("b1", "router-b"), ("x", "")):
        loop_thread.run(batcher.extend(CatchUpCall(key, 0, (3, 4), owner=owner)))
    assert batcher.owners() == {"router-a": 2, "router-b": 1}
    time.sleep(0.06)
    batcher.renew("router-b")  # b is alive; a died (no call, no renewal)
    assert sorted(loop_thread.run(batcher.expire_leases(0.05))) == ["a1", "a2"]
    assert sorted(runner.request_ids()) == ["b1", "x"]  # no owner: TTL only
    assert batcher.owners() == {"router-b": 1} and batcher.stats.orphans_freed == 2
    reply = loop_thread.run(batcher.extend(CatchUpCall("b1", 2, (5,), owner="router-b")))  # b carries on
    assert reply.logits is not None


def test_a_late_call_cannot_recreate_a_closed_session(pair, loop_thread):
    runner = ModelRunner(pair[1], "large")
    batcher = CatchUpBatcher(runner)
    loop_thread.run(batcher.close("k#1"))  # the caller gave up and closed before its call landed
    reply = loop_thread.run(batcher.extend(CatchUpCall("k#1", 0, (3, 4), owner="router-a")))
    assert reply.logits is None and "closed" in reply.lost and runner.request_ids() == []


class SlowEndpoint(FakeEndpoint):
    """Every catch-up waits `delay_s` before its replica sees it (LargeModel's inject_delay_ms)."""

    delay_s = 0.0

    def extend(self, call: CatchUpCall):
        replica = self.replicas[self.route(call.session_key)]
        real = replica.extend

        async def late(c):
            await asyncio.sleep(self.delay_s)
            return await real(c)

        replica.extend = late
        try:
            return super().extend(call)  # schedules the coroutine now (with the delay)
        finally:
            replica.extend = real


def test_a_slow_large_model_degrades_within_the_timeout_and_leaves_no_session(pair, tokenizer, loop_thread):
    endpoint = SlowEndpoint(pair[1], loop_thread)
    engine, remote = remote_engine(pair, tokenizer, endpoint)
    remote.timeout_s = 0.2
    req = request([3, 4, 5], max_tokens=12, router="always-large")
    request_id = engine.submit(req)
    for _ in range(4):  # four M_L tokens at full speed
        engine.step()
    endpoint.delay_s = 20.0  # far beyond the timeout: waiting for it would show
    start = time.monotonic()
    while engine.has_work():
        engine.step()
    seconds = time.monotonic() - start
    result = engine.finish(request_id)
    assert seconds < 10.0 and result.degraded and "no reply within 0.2 s" in result.degraded_reason  # not 20 s
    assert result.sources == (1,) * 4 + (0,) * 8
    assert result.token_ids[:4] == engine_for(pair, tokenizer).generate(req).token_ids[:4]
    time.sleep(3.2)  # the late call lands after the close: a tombstone, not a session
    assert not any(b.runner.request_ids() for b in endpoint.replicas)


def test_no_replica_to_create_a_session_on_is_unavailable(pair, tokenizer, loop_thread):
    endpoint = FakeEndpoint(pair[1], loop_thread)
    endpoint.dead = {0, 1}
    engine, remote = remote_engine(pair, tokenizer, endpoint)
    remote.timeout_s, remote.create_retries = 1.0, 2
    endpoint.route = lambda key: 0  # both dead; the router has not noticed
    result = engine.generate(request([3, 4], max_tokens=5, router="always-large"))
    assert result.degraded and "no replica answers" in result.degraded_reason and result.sources == (0,) * 5
    with pytest.raises(LargeUnavailable):
        remote.open("s")
        remote.extend([("s", [3, 4])])


class _BareIngress(Ingress.func_or_class):
    """The class Serve wraps, built without its Ray parts (no ASGI app to shut down)."""

    def __del__(self) -> None:
        pass


async def _running() -> str:
    return ""


class _FirstItemRouter:
    """A SmallModel handle whose stream yields one item: what the step loop answered."""

    def __init__(self, first) -> None:
        self.first, self.generate = first, self

    def remote(self, request, tokens):
        async def items():
            yield self.first

        return items()


@pytest.mark.parametrize(
    "first, status, code",
    [
        (Failed("RuntimeError: no tokenizer"), 500, None),
        (Failed("M_L is down", unavailable=True), 503, "large_unavailable"),
    ],
)
def test_a_request_the_step_loop_fails_at_admission_is_a_server_failure(first, status, code):
    ingress = object.__new__(_BareIngress)
    ingress.args = AppArgs()
    ingress.edge = Edge.from_config(ingress.args.access, ingress.args.limits)
    ingress.readiness = Readiness(_running)  # every replica of the app runs (test_readiness.py: until then)
    ingress.router = _FirstItemRouter(first)
    with pytest.raises(ServerFailure) as err:
        asyncio.run(ingress._open("cmpl-1", GenerateParams(max_tokens=2), "peer:test", True, [{"prompt": "hi"}]))
    assert (err.value.status, err.value.code, err.value.message) == (status, code, first.message)
    assert not ingress.edge.slots.open  # the client's slot is given back


# -- unexpected errors: the OpenAI body / INTERNAL with a message, never plain text -------------


def test_an_unhandled_http_error_is_a_500_with_the_openai_body():
    app = FastAPI()

    @app.get("/boom")
    async def boom():
        raise RuntimeError("nobody handled this")

    @app.get("/inf")
    async def inf():
        return {"threshold": float("inf")}  # Starlette refuses to encode it

    app.add_middleware(InternalErrors)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get("/boom"), await client.get("/inf")

    for response, hidden in zip(asyncio.run(main()), ("nobody handled this", "ValueError")):
        assert response.status_code == 500 and response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        # written for the client: the failure and the id the log has it under, no exception text
        assert hidden not in error["message"] and "the server failed" in error["message"]
        assert re.search(r"request err-[0-9a-f]{16}", error["message"])


class _Context:
    def __init__(self) -> None:
        self.code = self.details = None

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details) -> None:
        self.details = details


def test_an_unexpected_grpc_error_is_internal_with_a_message():
    ingress = object.__new__(_BareIngress)

    async def broken(*args, **kwargs):
        raise KeyError("a bug")

    ingress._open_pb = broken
    context = _Context()
    assert asyncio.run(ingress.Generate(pb.GenerateRequest(prompt="hi"), context)) == pb.GenerateResponse()
    assert context.code == grpc.StatusCode.INTERNAL and context.details.startswith("the server failed")
    assert "KeyError" not in context.details and re.search(r"request cmpl-[0-9a-f]{32}", context.details)

    async def stream():
        return [c async for c in ingress.GenerateStream(pb.GenerateRequest(prompt="hi"), context)]

    context = _Context()
    with pytest.raises(KeyError):
        asyncio.run(stream())
    assert context.code == grpc.StatusCode.INTERNAL and "KeyError" not in context.details
    assert context.details.startswith("the server failed")


def test_the_chaos_knob_fails_forwards_that_carry_a_doomed_request(pair):
    faults = FaultInjector(ModelRunner(pair[0], "small"), after=1)
    for request_id in ("ok", "doomed"):
        faults.open(request_id)
    faults.doom("doomed")
    faults.extend([("ok", [3]), ("doomed", [4])])  # its first forward passes
    with pytest.raises(InjectedFault):
        faults.extend([("ok", [5]), ("doomed", [6])])
    assert faults.inner.length("ok") == 2  # the forward ran first: its caches were written
    assert len(faults.extend([("ok", [7])])[0].logits) == 1 and faults.request_ids() == ["ok", "doomed"]
