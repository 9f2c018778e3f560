"""The HTTP clients' shared request/answer code (clients/http_client.py): the sync and async
clients send the same bodies and retry a refusal alike. No network: a mock transport."""

from __future__ import annotations

import asyncio
import json

import httpx

from clients.http_client import AsyncBackoffHTTPClient, BackoffHTTPClient
from clients.retry import Retry

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
