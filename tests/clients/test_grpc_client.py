"""The gRPC clients (clients/grpc_client.py) against an in-process gRPC server: unary and
streamed round trips, sync and async, a refusal mapped to BadRequestError, the last chunk
without a token. No Ray, no torch."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from clients.grpc_client import AsyncBackoffGrpcClient, BackoffGrpcClient
from clients.wire import backoff_pb2 as pb
from clients.wire import backoff_pb2_grpc as pb_grpc
from clients.wire.errors import BadRequestError
from clients.wire.proto import delta_from_pb


class FakeService(pb_grpc.BackoffServicer):
    def Generate(self, request, context):
        if request.router == "nope":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unknown router 'nope'")
        return pb.GenerateResponse(
            id="g",
            text=request.prompt.upper(),
            finish_reason="stop",
            usage=pb.Usage(completion_tokens=1),
            token_ids=[4],
            sources=[1],
        )

    def GenerateStream(self, request, context):
        for i, ch in enumerate(request.prompt):
            yield pb.GenerateChunk(id="g", text=ch, token_id=i, source=i % 2, index=i)
        yield pb.GenerateChunk(id="g", finish_reason="length", usage=pb.Usage(completion_tokens=len(request.prompt)))

    def Models(self, request, context):
        return pb.ModelsResponse(models=["backoff"])

    def Health(self, request, context):
        return pb.HealthResponse(ok=True)


@pytest.fixture(scope="module")
def grpc_target():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_BackoffServicer_to_server(FakeService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_grpc_client_round_trip(grpc_target):
    with BackoffGrpcClient(grpc_target) as client:
        out = client.complete("abc", max_tokens=3)
        assert (out.text, out.sources, out.finish_reason) == ("ABC", [1], "stop")
        deltas = list(client.stream("abc"))
        assert "".join(d.text for d in deltas) == "abc" and [d.source for d in deltas[:3]] == [0, 1, 0]
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 3
        assert deltas[-1].token_id is None
        assert client.models() == ["backoff"] and client.health()
        with pytest.raises(BadRequestError, match="unknown router"):
            client.complete("abc", router="nope")


def test_async_grpc_client_round_trip(grpc_target):
    async def run():
        async with AsyncBackoffGrpcClient(grpc_target) as client:
            out = await client.chat([{"role": "user", "content": "x"}])
            deltas = [d async for d in client.stream("hey")]
            return out, deltas

    out, deltas = asyncio.run(run())
    assert out.id == "g" and "".join(d.text for d in deltas) == "hey"


def test_last_chunk_carries_no_token():
    last = delta_from_pb(pb.GenerateChunk(id="x", finish_reason="stop", usage=pb.Usage(completion_tokens=4)))
    assert last.token_id is None and last.usage.completion_tokens == 4
