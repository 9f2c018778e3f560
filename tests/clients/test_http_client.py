"""The HTTP clients (clients/http_client.py): they parse bodies and SSE streams, map HTTP and
connection errors, and the sync and async clients have the same methods, send the same
bodies and retry a refusal alike. No network: a mock transport."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from clients.grpc_client import AsyncBackoffGrpcClient, BackoffGrpcClient
from clients.http_client import AsyncBackoffHTTPClient, BackoffHTTPClient
from clients.retry import Retry
from clients.wire.errors import BadRequestError, TransportError
from clients.wire.types import Usage

ANSWER = {"id": "c", "choices": [{"text": "a", "finish_reason": "length"}], "usage": {"completion_tokens": 1}}


def _refuse_once(sent: list[dict]):
    """A server that refuses the first request (503, Retry-After: 0) and answers the next."""

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        if len(sent) == 1:
            return httpx.Response(503, json={"error": {"message": "at capacity"}}, headers={"Retry-After": "0"})
        return httpx.Response(200, json=ANSWER)

    return handle


def test_sync_and_async_clients_send_the_same_body_and_retry_alike(monkeypatch):
    sent_sync, sent_async, slept = [], [], []
    monkeypatch.setattr("clients.http_client.time.sleep", slept.append)

    async def record(seconds):
        slept.append(seconds)

    monkeypatch.setattr("clients.http_client.asyncio.sleep", record)
    fields = dict(max_tokens=3, thresholds=[0.5], logprobs=2)
    policy = Retry(attempts=1, jitter=0.0)
    with BackoffHTTPClient(
        http=httpx.Client(transport=httpx.MockTransport(_refuse_once(sent_sync)), base_url="http://x"),
        model="m",
        retry=policy,
    ) as client:
        out = client.chat([{"role": "user", "content": "hi"}], **fields)

    async def run():
        http = httpx.AsyncClient(transport=httpx.MockTransport(_refuse_once(sent_async)), base_url="http://x")
        async with AsyncBackoffHTTPClient(http=http, model="m", retry=policy) as client:
            return await client.chat([{"role": "user", "content": "hi"}], **fields)

    assert asyncio.run(run()) == out and out.text == "a"
    assert sent_sync == sent_async and len(sent_sync) == 2 and slept == [0.0, 0.0]
    assert sent_sync[0] == {
        "max_tokens": 3,
        "thresholds": [0.5],
        "logprobs": True,
        "top_logprobs": 2,
        "messages": [{"role": "user", "content": "hi"}],
        "model": "m",
    }


# -- parsing and errors ------------------------------------------------------------------

USAGE = {
    "prompt_tokens": 2,
    "completion_tokens": 2,
    "total_tokens": 4,
    "small_tokens": 1,
    "large_tokens": 1,
    "large_calls": 1,
}


def _handler(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content) if request.content else {}
    if request.url.path == "/health":
        return httpx.Response(200, json={"status": "ok"})
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "backoff", "object": "model"}]})
    if body.get("top_k") == 99:
        return httpx.Response(400, json={"error": {"message": "top_k too large", "param": "top_k"}})
    if body.get("stream"):
        chunks = [
            {"id": "c", "choices": [{"text": t, "backoff": {"token_id": i, "source": i, "index": i}}]}
            for i, t in enumerate(["a", " b"])
        ]
        chunks.append({"id": "c", "choices": [{"text": "", "finish_reason": "length"}], "usage": None})
        chunks.append({"id": "c", "choices": [], "usage": USAGE})  # include_usage's chunk: the last delta's usage
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
    assert body["max_tokens"] == 2 and body["thresholds"] == [0.5] and "backoff_threshold" not in body
    choice = {"text": "a b", "finish_reason": "length", "backoff": {"token_ids": [5, 6], "sources": [0, 1]}}
    return httpx.Response(200, json={"id": "c", "choices": [choice], "usage": USAGE})


def test_http_client_parses_bodies_and_streams():
    http = httpx.Client(transport=httpx.MockTransport(_handler), base_url="http://x")
    with BackoffHTTPClient(http=http) as client:
        out = client.complete("hi", max_tokens=2, thresholds=[0.5])
        assert (out.text, out.sources, out.usage.backoff_rate) == ("a b", [0, 1], 0.5)
        deltas = list(client.stream("hi", max_tokens=2))
        assert [d.text for d in deltas] == ["a", " b", ""]
        assert [d.source for d in deltas[:2]] == [0, 1]
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage == Usage(**USAGE)
        assert client.models() == ["backoff"] and client.health()
        with pytest.raises(BadRequestError, match="top_k too large"):
            client.complete("hi", top_k=99)
        with pytest.raises(BadRequestError):
            list(client.stream("hi", top_k=99))


def test_async_http_client_has_the_same_methods():
    async def run():
        http = httpx.AsyncClient(transport=httpx.MockTransport(_handler), base_url="http://x")
        async with AsyncBackoffHTTPClient(http=http) as client:
            out = await client.complete("hi", max_tokens=2, backoff_threshold=0.5)  # the old spelling, sent new
            deltas = [d async for d in client.stream("hi")]
            return out, deltas, await client.models()

    out, deltas, models = asyncio.run(run())
    assert out.token_ids == [5, 6] and len(deltas) == 3 and models == ["backoff"]
    sync_methods = {m for m in dir(BackoffHTTPClient) if not m.startswith("_")}
    for cls in (AsyncBackoffHTTPClient, BackoffGrpcClient, AsyncBackoffGrpcClient):
        assert {m for m in dir(cls) if not m.startswith("_")} >= sync_methods - {"model", "timeout"}


def test_http_client_maps_connection_errors():
    with BackoffHTTPClient("http://127.0.0.1:9", timeout=2) as client:
        with pytest.raises(TransportError):
            client.complete("hi")
        assert client.health() is False
