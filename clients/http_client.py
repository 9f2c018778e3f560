"""HTTP clients (sync and async) of the OpenAI-compatible ingress, over httpx.

Method names are the same as the gRPC clients': complete, chat, stream, stream_chat,
models, health. Sampling and routing knobs go in a `GenerateParams` or as keyword fields.
A refusal for lack of capacity raises OverloadedError; `retry=Retry(...)` retries it,
bounded, after the server's Retry-After. `api_key` (default: the BACKOFF_API_KEY
environment variable) goes in `Authorization: Bearer`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import httpx

from clients.wire.errors import BackoffError, from_event, from_http, from_transport
from clients.retry import NO_RETRY, Retry
from clients.wire.types import (
    ChatMessage, Delta, GenerateParams, Generation, delta_from_chunk, generation_from_body, merge_params,
)

Messages = Sequence[ChatMessage | dict]


def _body(params: GenerateParams, model: str | None, stream: bool, **content) -> dict:
    body = params.model_dump(exclude_none=True, exclude_defaults=True)
    if "messages" in content and "logprobs" in body:  # OpenAI chat spells the count as a pair
        body.update(logprobs=True, top_logprobs=body.pop("logprobs"))
    body.update(content)
    if model:
        body["model"] = model
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def api_key_headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header of `api_key`, else of $BACKOFF_API_KEY, else none."""
    key = api_key if api_key is not None else os.environ.get("BACKOFF_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _messages(messages: Messages) -> list[dict]:
    return [m.model_dump() if isinstance(m, ChatMessage) else dict(m) for m in messages]


def _raise_for_status(response: httpx.Response, body: bytes) -> None:
    if response.status_code >= 400:
        raise from_http(response.status_code, body, response.headers.get("retry-after"))


def _sse_data(line: str) -> dict | None:
    """One SSE line -> the JSON of a `data:` event (None for other lines and [DONE]); an
    in-band error event raises."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    body = None if data == "[DONE]" else json.loads(data)
    if isinstance(body, dict) and "error" in body:
        raise from_event(body)
    return body


class BackoffHTTPClient:
    """Sync client. `with BackoffHTTPClient(url) as c: c.complete("Hello", max_tokens=8)`."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, model: str | None = None,
                 api_key: str | None = None, timeout: float = 120.0, retry: Retry = NO_RETRY,
                 http: httpx.Client | None = None) -> None:
        self.model = model
        self.retry = retry
        self._headers = api_key_headers(api_key)
        self._http = http or httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)

    def __enter__(self) -> "BackoffHTTPClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def complete(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> Generation:
        params = merge_params(params, fields)
        body = _body(params, self.model, False, prompt=prompt)
        return generation_from_body(self._post("/v1/completions", body), params.logprobs)

    def chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> Generation:
        body = _body(merge_params(params, fields), self.model, False, messages=_messages(messages))
        return generation_from_body(self._post("/v1/chat/completions", body))

    def stream(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> Iterator[Delta]:
        params = merge_params(params, fields)
        return self._stream("/v1/completions", _body(params, self.model, True, prompt=prompt), params.logprobs)

    def stream_chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> Iterator[Delta]:
        body = _body(merge_params(params, fields), self.model, True, messages=_messages(messages))
        return self._stream("/v1/chat/completions", body)

    def models(self) -> list[str]:
        return [m["id"] for m in self._get("/v1/models")["data"]]

    def health(self) -> bool:
        try:
            self._get("/health")
            return True
        except BackoffError:
            return False

    # -- transport --------------------------------------------------------------------------
    def _get(self, path: str) -> dict:
        return self._send(self._http.build_request("GET", path, headers=self._headers)).json()

    def _post(self, path: str, body: dict) -> dict:
        return self._send(self._http.build_request("POST", path, json=body, headers=self._headers)).json()

    def _stream(self, path: str, body: dict, top_n: int | None = None) -> Iterator[Delta]:
        response = self._send(self._http.build_request("POST", path, json=body, headers=self._headers), stream=True)
        try:
            for line in response.iter_lines():
                data = _sse_data(line)
                if data is not None:
                    yield delta_from_chunk(data, top_n)
        except httpx.TransportError as e:
            raise from_transport(e) from e
        finally:
            response.close()

    def _send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        """A successful response (a stream's before its body is read), refusals retried per `retry`."""
        for attempt in range(self.retry.attempts + 1):
            try:
                response = self._http.send(request, stream=stream)
                if response.status_code >= 400:
                    try:
                        _raise_for_status(response, response.read())
                    finally:
                        response.close()
                return response
            except httpx.TransportError as e:
                raise from_transport(e) from e
            except BackoffError as e:
                wait = self.retry.delay(e, attempt)
                if wait is None:
                    raise
                time.sleep(wait)
        raise AssertionError("unreachable: the last try raises or returns")


class AsyncBackoffHTTPClient:
    """Async client with the same methods; `stream` / `stream_chat` are async iterators."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, model: str | None = None,
                 api_key: str | None = None, timeout: float = 120.0, retry: Retry = NO_RETRY,
                 http: httpx.AsyncClient | None = None) -> None:
        self.model = model
        self.retry = retry
        self._headers = api_key_headers(api_key)
        self._http = http or httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout)

    async def __aenter__(self) -> "AsyncBackoffHTTPClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def complete(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> Generation:
        params = merge_params(params, fields)
        body = _body(params, self.model, False, prompt=prompt)
        return generation_from_body(await self._post("/v1/completions", body), params.logprobs)

    async def chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> Generation:
        body = _body(merge_params(params, fields), self.model, False, messages=_messages(messages))
        return generation_from_body(await self._post("/v1/chat/completions", body))

    def stream(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> AsyncIterator[Delta]:
        params = merge_params(params, fields)
        return self._stream("/v1/completions", _body(params, self.model, True, prompt=prompt), params.logprobs)

    def stream_chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> AsyncIterator[Delta]:
        body = _body(merge_params(params, fields), self.model, True, messages=_messages(messages))
        return self._stream("/v1/chat/completions", body)

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self._get("/v1/models"))["data"]]

    async def health(self) -> bool:
        try:
            await self._get("/health")
            return True
        except BackoffError:
            return False

    async def _get(self, path: str) -> dict:
        return (await self._send(self._http.build_request("GET", path, headers=self._headers))).json()

    async def _post(self, path: str, body: dict) -> dict:
        return (await self._send(self._http.build_request("POST", path, json=body, headers=self._headers))).json()

    async def _stream(self, path: str, body: dict, top_n: int | None = None) -> AsyncIterator[Delta]:
        response = await self._send(self._http.build_request("POST", path, json=body, headers=self._headers), stream=True)
        try:
            async for line in response.aiter_lines():
                data = _sse_data(line)
                if data is not None:
                    yield delta_from_chunk(data, top_n)
        except httpx.TransportError as e:
            raise from_transport(e) from e
        finally:
            await response.aclose()

    async def _send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        """A successful response (a stream's before its body is read), refusals retried per `retry`."""
        for attempt in range(self.retry.attempts + 1):
            try:
                response = await self._http.send(request, stream=stream)
                if response.status_code >= 400:
                    try:
                        _raise_for_status(response, await response.aread())
                    finally:
                        await response.aclose()
                return response
            except httpx.TransportError as e:
                raise from_transport(e) from e
            except BackoffError as e:
                wait = self.retry.delay(e, attempt)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
        raise AssertionError("unreachable: the last try raises or returns")
