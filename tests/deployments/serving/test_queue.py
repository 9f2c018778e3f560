"""Queue instead of shed (issue 57, item 6), with Ray not started: the deployments' user
classes (tests/support/serve_fakes.py: an Ingress over a SmallModel and a LargeModel of tiny
models) behind real HTTP. At the default admission 128 concurrent requests of one client all
complete with the in-process tokens, none refused (48 live, the rest wait in the replica's
queue); the SmallModel admits waiters in arrival order; past the queue and after
queue_timeout_s in it a request gets 503 + Retry-After with its code; a waiter that goes away
holds nothing; the per-client limit is off without API keys and on with them."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from backoff_core.types import SamplingParams
from deployments import ingress
from deployments.serving.outcomes import Admitted
from deployments.serving.requests import RoutingOverrides, ServeRequest
from tests.support.helpers import engine_for, request
from tests.support.remote_fakes import LoopThread
from tests.support.serve_fakes import FakeHandle, ingress_replica, large_replica, serving, small_replica
from tests.support.served_app import wait_until

ROUTING = {"router": "entropy", "thresholds": [0.4]}  # both models serve (tiny pair, peaky)


@contextlib.contextmanager
def _app(monkeypatch, pair, tokenizer, args: dict | None = None, delay_ms: float = 0.0):
    """(base URL, SmallModel) of an Ingress over a SmallModel and one LargeModel whose catch-ups
    take `delay_ms` more; `args` the app args both read (the defaults but the routing, unless given)."""
    lt = LoopThread()
    args = {"routing": ROUTING, **(args or {})}
    large = large_replica(monkeypatch, pair[1])
    large.reconfigure({"inject_delay_ms": delay_ms})
    small = small_replica(monkeypatch, pair[0], tokenizer, [FakeHandle([large], lt)], args)
    ingress_replica(monkeypatch, small, args)
    try:
        with serving(ingress.app) as base:
            yield base, small
    finally:
        small.loop.stop()
        large.batcher.shutdown()
        lt.stop()


def _body(i: int, max_tokens: int = 8, **fields) -> dict:
    return {
        "prompt": [3 + i % 11, 4 + i % 5, 5],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    } | fields


SMALL = {"router": "always-small"}  # a request that never waits for the (slowed) large model


def _idle(small) -> bool:
    info = small.info()
    return (info.admitted, info.waiting, info.live) == (0, 0, 0)


@pytest.mark.slow  # ~10 s on 2 cores: 128 requests in three rounds of 48
def test_128_concurrent_requests_of_one_client_all_complete_with_the_in_process_tokens(monkeypatch, pair, tokenizer):
    n = 128
    expected = engine_for(pair, tokenizer).generate_many(
        [request(_body(i)["prompt"], max_tokens=8, **ROUTING) for i in range(n)]
    )
    waited: list[int] = []

    async def main(base: str, small) -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n + 8)  # httpx's default pool (100) would queue them itself
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:

            async def watch() -> None:
                while True:
                    waited.append(small.info().waiting)
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            try:
                return await asyncio.gather(*[http.post("/v1/completions", json=_body(i)) for i in range(n)])
            finally:
                watcher.cancel()

    with _app(monkeypatch, pair, tokenizer) as (base, small):
        responses = asyncio.run(main(base, small))
        assert [r.status_code for r in responses] == [200] * n, {r.status_code: r.text for r in responses}
        tokens = [r.json()["choices"][0]["backoff"]["token_ids"] for r in responses]
        assert tokens == [list(e.token_ids) for e in expected]
        assert max(waited) > 0, "no request waited: the test did not exceed the live slots"
        info = small.info()
        assert info.admission == (48, 144, 0, 0) and _idle(small)  # nothing refused, nothing held


def test_waiters_are_admitted_in_arrival_order_and_one_that_goes_away_holds_nothing(monkeypatch, pair, tokenizer):
    """Two live slots held by long streams; eight requests queue one after another, a ninth is
    cancelled while it waits (as Serve cancels a request whose caller left): the engine admits
    the eight in the order they came, and the queue forgets the ninth."""
    admitted: list[str] = []
    lt = LoopThread()
    large = large_replica(monkeypatch, pair[1])
    args = {"admission": {"max_live_requests": 2, "max_waiting_requests": 10}}
    small = small_replica(monkeypatch, pair[0], tokenizer, [FakeHandle([large], lt)], args)
    admit = small.loop.admit

    def recording(req, policy):
        admitted.append(req.request_id)
        return admit(req, policy)

    small.loop.admit = recording

    async def main() -> list[list]:
        holders = [small.generate(_request(f"hold{i}", max_tokens=400)) for i in range(2)]
        for holder in holders:
            assert isinstance(await anext(holder), Admitted)
        waiters = []
        for i in range(8):
            waiters.append(asyncio.create_task(_collect(small, f"w{i}")))
            while small.gate.waiting < i + 1:  # queued before the next one arrives
                await asyncio.sleep(0.001)
        leaving = asyncio.create_task(_collect(small, "gone"))
        while small.gate.waiting < 9:
            await asyncio.sleep(0.001)
        leaving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
        assert small.gate.waiting == 8
        for holder in holders:
            await holder.aclose()  # the slots pass to the queue's head
        return await asyncio.gather(*waiters)

    try:
        outcomes = asyncio.run(main())
        assert [w[0].request_id for w in outcomes] == [f"w{i}" for i in range(8)]
        assert admitted == ["hold0", "hold1"] + [f"w{i}" for i in range(8)]  # FIFO; "gone" never reached the engine
        wait_until(lambda: _idle(small), "the waiters' slots were given back", timeout_s=10)
    finally:
        small.loop.stop()
        large.batcher.shutdown()
        lt.stop()


def _request(request_id: str, max_tokens: int = 6) -> ServeRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return ServeRequest(request_id, sampling, RoutingOverrides(), prompt_ids=(3, 4, 5))


async def _collect(small, request_id: str) -> list:
    return [item async for item in small.generate(_request(request_id))]


@contextlib.asynccontextmanager
async def _holding(http: httpx.AsyncClient):
    """A stream routed to the large model, whose catch-ups are slowed (`_app(delay_ms=...)`),
    read to its first token: it holds a live slot until the block ends and it is closed."""
    body = _body(0, max_tokens=400, stream=True, router="always-large")
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.aiter_lines()  # kept: an iterator dropped is closed, and the stream with it
        await anext(lines)
        yield


def test_past_the_queue_and_past_its_timeout_a_request_gets_503_with_retry_after_and_its_code(
    monkeypatch, pair, tokenizer
):
    """One live slot, one waiter: a third request is refused at once (`overloaded`); the waiter
    that does not get the slot within queue_timeout_s is refused then (`queue_timeout`); both
    counted; once the slot is free the next request is served."""
    admission = {"max_live_requests": 1, "max_waiting_requests": 1, "queue_timeout_s": 0.5, "retry_after_s": 3}

    async def main(base: str, small):
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            async with _holding(http):
                waiting = asyncio.create_task(http.post("/v1/completions", json=_body(1, **SMALL)))
                while small.gate.waiting < 1:
                    await asyncio.sleep(0.005)
                full = await http.post("/v1/completions", json=_body(2, **SMALL))
                timed_out = await waiting
            while not _idle(small):  # the closed stream gave its slot back
                await asyncio.sleep(0.01)
            served = await http.post("/v1/completions", json=_body(3, **SMALL))
            return full, timed_out, served

    with _app(monkeypatch, pair, tokenizer, {"admission": admission}, delay_ms=50) as (base, small):
        full, timed_out, served = asyncio.run(main(base, small))
        for response, code in ((full, "overloaded"), (timed_out, "queue_timeout")):
            assert response.status_code == 503 and response.headers["Retry-After"] == "3", response.text
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", code)
        assert "1 live and 1 waiting" in full.json()["error"]["message"]
        assert "queue_timeout_s" in timed_out.json()["error"]["message"]
        assert served.status_code == 200 and small.info().admission == (1, 1, 1, 1)


@pytest.mark.parametrize("keys", [False, True])
def test_the_per_client_limit_is_off_without_api_keys_and_on_with_them(monkeypatch, pair, tokenizer, keys):
    """At the default max_concurrent_per_client (auto) and one live slot + one queued: without
    keys a client's third request meets the full queue (503), not a per-client limit; with keys
    the limit is the replica's live + queue (2), so the third is this client's 429."""
    args = {"admission": {"max_live_requests": 1, "max_waiting_requests": 1, "queue_timeout_s": 30}}
    if keys:
        args["access"] = {"api_keys": ["k1"]}
    headers = {"Authorization": "Bearer k1"} if keys else None

    async def main(base: str, small) -> httpx.Response:
        async with httpx.AsyncClient(base_url=base, timeout=60, headers=headers) as http:
            async with _holding(http):
                waiting = asyncio.create_task(http.post("/v1/completions", json=_body(1, **SMALL)))
                while small.gate.waiting < 1:
                    await asyncio.sleep(0.005)
                third = await http.post("/v1/completions", json=_body(2, **SMALL))
            assert (await waiting).status_code == 200  # the waiter got the slot once it was free
            return third

    with _app(monkeypatch, pair, tokenizer, args, delay_ms=50) as (base, small):
        third = asyncio.run(main(base, small))
        code = third.json()["error"]["code"]
        if keys:
            assert (third.status_code, code) == (429, "too_many_concurrent_requests") and "Retry-After" in third.headers
            assert small.info().admission[2] == 0  # refused at the Ingress: it never reached the queue
        else:
            assert (third.status_code, code) == (503, "overloaded") and small.info().admission[2] == 1
