"""gRPC clients (sync and async) of the Backoff service behind Ray Serve's gRPC proxy.

Same method names as the HTTP clients. Ray Serve picks the application from the
`application` metadata key; pass `application=` when more than one app is deployed.
RESOURCE_EXHAUSTED (the server is at capacity) raises OverloadedError; `retry=Retry(...)`
retries it, bounded: a stream only before its first chunk. `api_key` (default: the
BACKOFF_API_KEY environment variable) goes in the metadata `authorization: Bearer <key>`.

The two classes differ only in how they wait (blocking or awaited): messages are built in
`_Client` (through clients.wire.proto) and read by clients.wire.proto / errors, once.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from clients.retry import NO_RETRY, Retry
from clients.wire import backoff_pb2 as pb
from clients.wire import backoff_pb2_grpc as pb_grpc
from clients.wire.errors import from_grpc
from clients.wire.proto import deltas_from_pb, generation_from_pb, request_to_pb
from clients.wire.types import ChatMessage, Delta, GenerateParams, Generation, merge_params

Messages = Sequence[ChatMessage | dict]


# grpc's default receive cap is 4 MiB; an answer within the server's limits may pass it
# (n choices x top logprobs: the server refuses above limits.max_answer_bytes, 64 MiB)
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 256 << 20),)


def call_metadata(application: str | None, api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """Metadata of every call: the Serve application, the API key (else $BACKOFF_API_KEY)."""
    key = api_key if api_key is not None else os.environ.get("BACKOFF_API_KEY")
    metadata = ((("application", application),) if application else ()) + (
        (("authorization", f"Bearer {key}"),) if key else ()
    )
    return metadata or None


class _Client:
    """Settings and request messages shared by the sync and async clients."""

    def __init__(
        self, model: str | None, application: str | None, timeout: float, retry: Retry, api_key: str | None
    ) -> None:
        self.model = model
        self.timeout = timeout
        self.retry = retry
        self._metadata = call_metadata(application, api_key)

    @property
    def _options(self) -> dict:
        """Keyword arguments of every stub call."""
        return {"timeout": self.timeout, "metadata": self._metadata}

    def _completion(self, prompt: str | list[int], params: GenerateParams | None, fields: dict) -> pb.GenerateRequest:
        return request_to_pb(merge_params(params, fields), model=self.model, prompt=prompt)

    def _chat(self, messages: Messages, params: GenerateParams | None, fields: dict) -> pb.GenerateRequest:
        chat = [m if isinstance(m, ChatMessage) else ChatMessage(**m) for m in messages]
        return request_to_pb(merge_params(params, fields), model=self.model, messages=chat)


class BackoffGrpcClient(_Client):
    """Sync client: `BackoffGrpcClient("127.0.0.1:9000").complete("Hello", max_tokens=8)`."""

    def __init__(
        self,
        target: str = "127.0.0.1:9000",
        *,
        model: str | None = None,
        application: str | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
        retry: Retry = NO_RETRY,
        channel: grpc.Channel | None = None,
    ) -> None:
        super().__init__(model, application, timeout, retry, api_key)
        self._channel = channel or grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.BackoffStub(self._channel)

    def __enter__(self) -> "BackoffGrpcClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def complete(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> Generation:
        return self._unary(self._completion(prompt, params, fields))

    def chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> Generation:
        return self._unary(self._chat(messages, params, fields))

    def stream(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> Iterator[Delta]:
        return self._streaming(self._completion(prompt, params, fields))

    def stream_chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> Iterator[Delta]:
        return self._streaming(self._chat(messages, params, fields))

    def models(self) -> list[str]:
        try:
            return list(self._stub.Models(pb.ModelsRequest(), **self._options).models)
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    def health(self) -> bool:
        try:
            return self._stub.Health(pb.HealthRequest(), **self._options).ok
        except grpc.RpcError:
            return False

    def _unary(self, request: pb.GenerateRequest) -> Generation:
        for attempt in range(self.retry.attempts + 1):
            try:
                return generation_from_pb(self._stub.Generate(request, **self._options))
            except grpc.RpcError as e:
                error = from_grpc(e)
            time.sleep(self.retry.wait(error, attempt))
        raise AssertionError("unreachable: the last try raises or returns")

    def _streaming(self, request: pb.GenerateRequest) -> Iterator[Delta]:
        for attempt in range(self.retry.attempts + 1):
            call = self._stub.GenerateStream(request, **self._options)
            started = False
            try:
                for chunk in call:
                    started = True
                    yield from deltas_from_pb(chunk)  # one token, or several in one message
                return
            except grpc.RpcError as e:
                error = from_grpc(e)
            finally:
                call.cancel()  # the caller stopped early: tell the server (frees the sessions)
            if started:  # tokens were delivered: sending again would repeat them
                raise error
            time.sleep(self.retry.wait(error, attempt))


class AsyncBackoffGrpcClient(_Client):
    """Async client (grpc.aio) with the same methods."""

    def __init__(
        self,
        target: str = "127.0.0.1:9000",
        *,
        model: str | None = None,
        application: str | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
        retry: Retry = NO_RETRY,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        super().__init__(model, application, timeout, retry, api_key)
        self._channel = channel or grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.BackoffStub(self._channel)

    async def __aenter__(self) -> "AsyncBackoffGrpcClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def complete(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> Generation:
        return await self._unary(self._completion(prompt, params, fields))

    async def chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> Generation:
        return await self._unary(self._chat(messages, params, fields))

    def stream(self, prompt: str | list[int], params: GenerateParams | None = None, **fields) -> AsyncIterator[Delta]:
        return self._streaming(self._completion(prompt, params, fields))

    def stream_chat(self, messages: Messages, params: GenerateParams | None = None, **fields) -> AsyncIterator[Delta]:
        return self._streaming(self._chat(messages, params, fields))

    async def models(self) -> list[str]:
        try:
            return list((await self._stub.Models(pb.ModelsRequest(), **self._options)).models)
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    async def health(self) -> bool:
        try:
            return (await self._stub.Health(pb.HealthRequest(), **self._options)).ok
        except grpc.RpcError:
            return False

    async def _unary(self, request: pb.GenerateRequest) -> Generation:
        for attempt in range(self.retry.attempts + 1):
            try:
                return generation_from_pb(await self._stub.Generate(request, **self._options))
            except grpc.RpcError as e:
                error = from_grpc(e)
            await asyncio.sleep(self.retry.wait(error, attempt))
        raise AssertionError("unreachable: the last try raises or returns")

    async def _streaming(self, request: pb.GenerateRequest) -> AsyncIterator[Delta]:
        for attempt in range(self.retry.attempts + 1):
            call = self._stub.GenerateStream(request, **self._options)
            started = False
            try:
                async for chunk in call:
                    started = True
                    for delta in deltas_from_pb(chunk):  # one token, or several in one message
                        yield delta
                return
            except grpc.RpcError as e:
                error = from_grpc(e)
            finally:
                call.cancel()  # the caller stopped early: tell the server (frees the sessions)
            if started:  # tokens were delivered: sending again would repeat them
                raise error
            await asyncio.sleep(self.retry.wait(error, attempt))
