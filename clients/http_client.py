"""HTTP clients (sync and async) of the OpenAI-compatible ingress, over httpx.

Method names are the same as the gRPC clients': complete, chat, stream, stream_chat,
models, health. Sampling and routing knobs go in a `GenerateParams` or as keyword fields.
A refusal for lack of capacity raises OverloadedError; `retry=Retry(...)` retries it,
bounded, after the server's Retry-After. `api_key` (default: the BACKOFF_API_KEY
environment variable) goes in `Authorization: Bearer`.

The two classes differ only in how they wait (blocking or awaited): each request is built,
and each answer read, once, in `_Call` and `_Client` below.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import httpx

from clients.retry import NO_RETRY, Retry
from clients.wire.errors import BackoffError, from_event, from_http, from_transport
from clients.wire.openai import delta_from_chunk, generation_from_body
from clients.wire.types import ChatMessage, Delta, GenerateParams, Generation, merge_params

Messages = Sequence[ChatMessage | dict]


def api_key_headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header of `api_key`, else of $BACKOFF_API_KEY, else none."""
    key = api_key if api_key is not None else os.environ.get("BACKOFF_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


# -- codec: requests built and answers read once, for both clients ----------------------------


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


def _messages(messages: Messages) -> list[dict]:
    return [m.model_dump() if isinstance(m, ChatMessage) else dict(m) for m in messages]


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


class _LastDelta:
    """A stream's deltas as the clients yield them: the choice's last delta (finish_reason)
    waits for the usage chunk after it (stream_options.include_usage) and carries its usage,
    as the gRPC stream's last chunk does."""

    def __init__(self) -> None:
        self.held: Delta | None = None

    def push(self, delta: Delta) -> list[Delta]:
        held, self.held = self.held, None
        if held is not None and delta.usage is not None and delta.token_id is None and not delta.text:
            return [held.model_copy(update={"usage": delta.usage})]
        if delta.finish_reason is not None and delta.usage is None:
            self.held = delta
            return [held] if held is not None else []
        return [d for d in (held, delta) if d is not None]

    def end(self) -> list[Delta]:
        return [self.held] if self.held is not None else []


def _error(response: httpx.Response, body: bytes) -> BackoffError:
    return from_http(response.status_code, body, response.headers.get("retry-after"))


def _model_ids(body: dict) -> list[str]:
    return [m["id"] for m in body["data"]]


@dataclass(frozen=True)
class _Call:
    """One generation request: where it goes, its JSON body, and how its answer reads."""

    path: str
    body: dict
    top_n: int | None = None  # completions' logprobs count: their answers list the sampled token after the top n

    def generation(self, body: dict) -> Generation:
        return generation_from_body(body, self.top_n)

    def delta(self, line: str) -> Delta | None:
        """One SSE line -> its delta; None for lines that carry none."""
        data = _sse_data(line)
        return None if data is None else delta_from_chunk(data, self.top_n)


class _Client:
    """Settings and request building shared by the sync and async clients (`_http` is an
    httpx.Client or httpx.AsyncClient: both build requests the same way)."""

    _http: httpx.Client | httpx.AsyncClient

    def __init__(self, model: str | None, api_key: str | None, retry: Retry) -> None:
        self.model = model
        self.retry = retry
        self._headers = api_key_headers(api_key)

    def _completion(
        self, prompt: str | list[int], params: GenerateParams | None, fields: dict, stream: bool = False
    ) -> _Call:
        params = merge_params(params, fields)
        return _Call("/v1/completions", _body(params, self.model, stream, prompt=prompt), params.logprobs)

    def _chat(self, messages: Messages, params: GenerateParams | None, fields: dict, stream: bool = False) -> _Call:
        body = _body(merge_params(params, fields), self.model, stream, messages=_messages(messages))
        return _Call("/v1/chat/completions", body)

    def _post(self, call: _Call) -> httpx.Request:
        return self._http.build_request("POST", call.path, json=call.body, headers=self._headers)

    def _get(self, path: str) -> httpx.Request:
        return self._http.build_request("GET", path, headers=self._headers)


# -- the clients: the same methods, blocking or awaited ----------------------------------------


class BackoffHTTPClient(_Client):
    """Sync client. `with BackoffHTTPClient(url) as c: c.complete("Hello", max_tokens=8)`."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
        retry: Retry = NO_RETRY,
        http: httpx.Client | None = None,
    ) -> None:
        super().__init__(model, api_key, retry)
        self._http = http or httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)

    def __enter__(self) -> "BackoffHTTPClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def complete(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> Generation:
        return self._generate(self._completion(prompt, params, fields))

    def chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> Generation:
        return self._generate(self._chat(messages, params, fields))

    def stream(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> Iterator[Delta]:
        return self._stream(self._completion(prompt, params, fields, stream=True))

    def stream_chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> Iterator[Delta]:
        return self._stream(self._chat(messages, params, fields, stream=True))

    def models(self) -> list[str]:
        return _model_ids(self._send(self._get("/v1/models")).json())

    def health(self) -> bool:
        try:
            self._send(self._get("/health"))
            return True
        except BackoffError:
            return False

    def _generate(self, call: _Call) -> Generation:
        return call.generation(self._send(self._post(call)).json())

    def _stream(self, call: _Call) -> Iterator[Delta]:
        response = self._send(self._post(call), stream=True)
        last = _LastDelta()
        try:
            for line in response.iter_lines():
                if (delta := call.delta(line)) is not None:
                    yield from last.push(delta)
            yield from last.end()
        except httpx.TransportError as e:
            raise from_transport(e) from e
        finally:
            response.close()

    def _send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        """A successful response (a stream's before its body is read), refusals retried per `retry`."""
        for attempt in range(self.retry.attempts + 1):
            try:
                return self._send_once(request, stream)
            except BackoffError as e:
                time.sleep(self.retry.wait(e, attempt))
        raise AssertionError("unreachable: the last try raises or returns")

    def _send_once(self, request: httpx.Request, stream: bool) -> httpx.Response:
        try:
            response = self._http.send(request, stream=stream)
            if response.status_code >= 400:
                try:
                    raise _error(response, response.read())
                finally:
                    response.close()
            return response
        except httpx.TransportError as e:
            raise from_transport(e) from e


class AsyncBackoffHTTPClient(_Client):
    """Async client with the same methods; `stream` / `stream_chat` are async iterators."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
        retry: Retry = NO_RETRY,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(model, api_key, retry)
        self._http = http or httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout)

    async def __aenter__(self) -> "AsyncBackoffHTTPClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def complete(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> Generation:
        return await self._generate(self._completion(prompt, params, fields))

    async def chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> Generation:
        return await self._generate(self._chat(messages, params, fields))

    def stream(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> AsyncIterator[Delta]:
        return self._stream(self._completion(prompt, params, fields, stream=True))

    def stream_chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> AsyncIterator[Delta]:
        return self._stream(self._chat(messages, params, fields, stream=True))

    async def models(self) -> list[str]:
        return _model_ids((await self._send(self._get("/v1/models"))).json())

    async def health(self) -> bool:
        try:
            await self._send(self._get("/health"))
            return True
        except BackoffError:
            return False

    async def _generate(self, call: _Call) -> Generation:
        return call.generation((await self._send(self._post(call))).json())

    async def _stream(self, call: _Call) -> AsyncIterator[Delta]:
        response = await self._send(self._post(call), stream=True)
        last = _LastDelta()
        try:
            async for line in response.aiter_lines():
                if (delta := call.delta(line)) is not None:
                    for d in last.push(delta):
                        yield d
            for d in last.end():
                yield d
        except httpx.TransportError as e:
            raise from_transport(e) from e
        finally:
            await response.aclose()

    async def _send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        """A successful response (a stream's before its body is read), refusals retried per `retry`."""
        for attempt in range(self.retry.attempts + 1):
            try:
                return await self._send_once(request, stream)
            except BackoffError as e:
                await asyncio.sleep(self.retry.wait(e, attempt))
        raise AssertionError("unreachable: the last try raises or returns")

    async def _send_once(self, request: httpx.Request, stream: bool) -> httpx.Response:
        try:
            response = await self._http.send(request, stream=stream)
            if response.status_code >= 400:
                try:
                    raise _error(response, await response.aread())
                finally:
                    await response.aclose()
            return response
        except httpx.TransportError as e:
            raise from_transport(e) from e
