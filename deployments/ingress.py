"""Ingress deployment: OpenAI-compatible HTTP (FastAPI) and gRPC (Ray Serve's gRPC proxy).

No model here. A request is validated at the edge (pydantic), sent to a SmallRouter as a
ServeRequest, and its stream of items (Admitted, TokenEvent ..., GenerationResult) is
turned into SSE chunks, one JSON body, or protobuf messages. The first item decides the
status: a Rejected request is a 400 / INVALID_ARGUMENT before anything is streamed.

Failures after admission: a SmallRouter replica that dies under a request (its stream
raises a Ray actor error) and a larger model that failed a request (on_large_failure =
fail) are "unavailable": HTTP 503 with an OpenAI error body for a unary request, an
in-band OpenAI error event then [DONE] for an SSE stream (its 200 is already sent), gRPC
UNAVAILABLE; other failures are 500 / INTERNAL. The client may retry either.
"""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from backoff_core.types import GenerationResult, TokenEvent
from clients import backoff_pb2 as pb
from clients.proto import params_from_pb, prompt_from_pb
from clients.types import ChatCompletionRequest, CompletionRequest, GenerateParams, ModelCard, ModelList

from .config import AppArgs
from .engine_loop import Admitted, Failed, Rejected
from .formats import chunk_body, error_body, final_chunk_body, pb_chunk, pb_final_chunk, pb_response, response_body
from .requests import serve_request

app = FastAPI(title="Backoff Serve", description="Backoff decoding: a small and a large LM, one live threshold.")


class ClientError(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


class ServerFailure(RuntimeError):
    """Serving failed; status 503 when a part of the chain is down or too slow."""

    def __init__(self, message: str, status: int = 500, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


ROUTER_LOST = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)


def _failure(item: Rejected | Failed) -> ServerFailure:
    if isinstance(item, Failed) and item.unavailable:
        return ServerFailure(item.message, 503, "large_unavailable")
    return ServerFailure(item.message)


async def _guarded(stream: DeploymentResponseGenerator) -> AsyncIterator:
    """A SmallRouter's stream. The router failing under it becomes a ServerFailure; a
    caller that stops early (disconnect, cancel) cancels the router's request here, not
    trusting Ray's recursive cancel from this replica (under load it misses some)."""
    ended = False
    try:
        async for item in stream:
            ended = isinstance(item, (GenerationResult, Rejected, Failed))
            yield item
    except ROUTER_LOST as exc:
        ended = True
        raise ServerFailure(f"the small router serving this request was lost ({type(exc).__name__}); "
                            f"retry the request", 503, "router_unavailable") from exc
    except Exception as exc:  # noqa: BLE001 - reported to the client, not a broken connection
        ended = True
        raise ServerFailure(f"{type(exc).__name__}: {exc}") from exc
    finally:
        if not ended:
            stream.cancel()


def _error_response(status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


@app.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    message = f"{'.'.join(loc) + ': ' if loc else ''}{first.get('msg', 'invalid request')}"
    return _error_response(400, message, "invalid_request_error", ".".join(loc) or None)


@app.exception_handler(ClientError)
async def _client_error(request: Request, exc: ClientError) -> JSONResponse:
    return _error_response(exc.status, exc.message, "invalid_request_error", exc.param, exc.code)


@app.exception_handler(ServerFailure)
async def _server_failure(request: Request, exc: ServerFailure) -> JSONResponse:
    return _error_response(exc.status, exc.message, "server_error", code=exc.code)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _collect(stream: AsyncIterator) -> GenerationResult:
    try:
        async for item in stream:
            if isinstance(item, GenerationResult):
                return item
            if isinstance(item, (Rejected, Failed)):
                raise _failure(item)
        raise ServerFailure("the stream ended without a result")
    finally:
        await stream.aclose()


def _events(item) -> tuple[TokenEvent, ...]:
    return item if isinstance(item, tuple) else (item,)


def _set_status(context: RayServegRPCContext, exc: Exception) -> None:
    if isinstance(exc, ClientError):
        code = grpc.StatusCode.NOT_FOUND if exc.status == 404 else grpc.StatusCode.INVALID_ARGUMENT
        context.set_code(code)
        context.set_details(exc.message)
    elif isinstance(exc, ServerFailure) and exc.status == 503:
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details(exc.message)
    else:
        context.set_code(grpc.StatusCode.INTERNAL)
        context.set_details(str(exc))


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError) and exc.errors():
        e = exc.errors()[0]
        return f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}"
    return str(exc)


@serve.deployment(max_ongoing_requests=512)
@serve.ingress(app)
class Ingress:
    def __init__(self, router: DeploymentHandle, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.model_name = self.args.models.served_name
        self.router = router.options(stream=True)
        self.router_unary = router

    async def _chain_ok(self) -> str:
        """'' when a SmallRouter answers within 5 s, else why not."""
        try:
            await asyncio.wait_for(self.router_unary.info.remote(), 5.0)
            return ""
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return f"small router unavailable: {type(exc).__name__}"

    # -- HTTP -------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        problem = await self._chain_ok()
        if problem:
            return _error_response(503, problem, "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict:
        return ModelList(data=[ModelCard(id=self.model_name)]).model_dump()

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self._http(body, chat=False, prompt=body.prompt)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        return await self._http(body, chat=True, messages=body.messages)

    async def _http(self, body, chat: bool, **content):
        if body.model and body.model != self.model_name:
            raise ClientError(f"model {body.model!r} is not served here; GET /v1/models lists "
                              f"{self.model_name!r}", "model", 404, "model_not_found")
        params = GenerateParams(**body.model_dump(include=set(GenerateParams.model_fields)))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = await self._open(rid, params, tokens=body.stream, **content)
        created = int(time.time())
        if not body.stream:
            result = await _collect(stream)
            return response_body(rid, self.model_name, created, result, chat)
        return StreamingResponse(self._sse(rid, created, stream, chat), media_type="text/event-stream")

    async def _sse(self, rid: str, created: int, stream: AsyncIterator, chat: bool) -> AsyncIterator[str]:
        try:
            async for item in stream:
                if isinstance(item, (TokenEvent, tuple)):
                    yield "".join(_sse(chunk_body(rid, self.model_name, created, e, chat)) for e in _events(item))
                elif isinstance(item, GenerationResult):
                    yield _sse(final_chunk_body(rid, self.model_name, created, item, chat))
                elif isinstance(item, (Rejected, Failed)):
                    raise _failure(item)
        except ServerFailure as exc:  # after admission (the 200 is out): report in-band, as OpenAI does
            yield _sse(error_body(exc.message, "server_error", code=exc.code))
        finally:
            await stream.aclose()  # closed early (a disconnect while a chunk was sent): cancels the router's request
        yield "data: [DONE]\n\n"

    # -- gRPC -------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext) -> pb.GenerateResponse:
        rid = f"cmpl-{uuid.uuid4().hex}"
        try:
            stream = await self._open_pb(rid, request, tokens=False)
            return pb_response(rid, await _collect(stream))
        except (ClientError, ServerFailure) as exc:
            _set_status(grpc_context, exc)
            return pb.GenerateResponse()

    async def GenerateStream(self, request: pb.GenerateRequest,
                             grpc_context: RayServegRPCContext) -> AsyncIterator[pb.GenerateChunk]:
        rid = f"cmpl-{uuid.uuid4().hex}"
        try:
            stream = await self._open_pb(rid, request)
        except (ClientError, ServerFailure) as exc:
            _set_status(grpc_context, exc)
            raise  # nothing was streamed: Serve sends the status set above only with an exception
        try:
            async for item in stream:
                if isinstance(item, (TokenEvent, tuple)):
                    for event in _events(item):
                        yield pb_chunk(rid, event)
                elif isinstance(item, GenerationResult):
                    yield pb_final_chunk(rid, item)
                elif isinstance(item, (Rejected, Failed)):
                    raise _failure(item)
        except ServerFailure as exc:
            _set_status(grpc_context, exc)
            raise
        finally:
            await stream.aclose()

    async def Models(self, request: pb.ModelsRequest, grpc_context: RayServegRPCContext) -> pb.ModelsResponse:
        return pb.ModelsResponse(models=[self.model_name])

    async def Health(self, request: pb.HealthRequest, grpc_context: RayServegRPCContext) -> pb.HealthResponse:
        problem = await self._chain_ok()
        return pb.HealthResponse(ok=not problem, detail=problem or "ok")

    async def _open_pb(self, rid: str, request: pb.GenerateRequest, tokens: bool = True) -> AsyncIterator:
        if request.model and request.model != self.model_name:
            raise ClientError(f"model {request.model!r} is not served here", "model", 404, "model_not_found")
        try:
            params = params_from_pb(request)
            prompt, messages = prompt_from_pb(request)
        except (ValidationError, ValueError) as exc:
            raise ClientError(_first_error(exc)) from None
        return await self._open(rid, params, tokens=tokens, prompt=prompt, messages=messages)

    # -- both -------------------------------------------------------------------------------
    async def _open(self, rid: str, params: GenerateParams, tokens: bool, **content) -> AsyncIterator:
        """Send the request to a SmallRouter; returns its stream once it is admitted.
        tokens=False (unary): the stream carries no TokenEvents, only the result."""
        try:
            request = serve_request(rid, params, default_max_tokens=self.args.default_max_tokens, **content)
        except ValueError as exc:
            raise ClientError(str(exc)) from None
        stream = _guarded(self.router.generate.remote(request, tokens))
        first = await stream.__anext__()
        if isinstance(first, Rejected):
            raise ClientError(first.message)
        if isinstance(first, Failed):
            raise _failure(first)
        assert isinstance(first, Admitted), first
        return stream

