"""Ingress deployment: OpenAI-compatible HTTP (FastAPI) and gRPC (Ray Serve's gRPC proxy).

No model here. A request is validated at the edge (pydantic), sent to a SmallRouter as a
ServeRequest, and its stream of items (Admitted, TokenEvent ..., GenerationResult) is
turned into SSE chunks, one JSON body, or protobuf messages. The first item decides the
status: a Rejected request is a 400 / INVALID_ARGUMENT before anything is streamed, an
Overloaded one (or Serve's BackPressureError: a full queue) a 503 + Retry-After /
RESOURCE_EXHAUSTED.
"""

import asyncio
import json
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from backoff_core.types import GenerationResult, TokenEvent
from clients import backoff_pb2 as pb
from clients.proto import params_from_pb, prompt_from_pb
from clients.types import ChatCompletionRequest, CompletionRequest, GenerateParams, ModelCard, ModelList

from .admission import Overloaded
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
    pass


class Overload(ServerFailure):
    """The chain is at capacity: refused before admission, the client may retry."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str:  # RFC 9110 delay-seconds: an integer, rounded up
        return str(max(0, math.ceil(self.retry_after_s)))

    def __reduce__(self):  # the gRPC path pickles it to the proxy: keep both arguments
        return type(self), (str(self), self.retry_after_s)


@dataclass(frozen=True)
class IngressInfo:
    pid: int
    replica: str


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


@app.exception_handler(Overload)
async def _overload(request: Request, exc: Overload) -> JSONResponse:
    return JSONResponse(error_body(str(exc), "server_error", None, "overloaded"), status_code=503,
                        headers={"Retry-After": exc.retry_after})


@app.exception_handler(ServerFailure)
async def _server_failure(request: Request, exc: ServerFailure) -> JSONResponse:
    return _error_response(500, str(exc), "server_error")


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _collect(stream: AsyncIterator) -> GenerationResult:
    async for item in stream:
        if isinstance(item, GenerationResult):
            return item
        if isinstance(item, (Rejected, Failed)):
            raise ServerFailure(item.message)
    raise ServerFailure("the stream ended without a result")


def _events(item) -> tuple[TokenEvent, ...]:
    return item if isinstance(item, tuple) else (item,)


def _set_status(context: RayServegRPCContext, exc: Exception) -> None:
    if isinstance(exc, ClientError):
        code = grpc.StatusCode.NOT_FOUND if exc.status == 404 else grpc.StatusCode.INVALID_ARGUMENT
        context.set_code(code)
        context.set_details(exc.message)
    elif isinstance(exc, Overload):
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details(str(exc))
        # reaches the client on unary calls; Serve's proxy drops it when a stream raises
        context.set_trailing_metadata([("retry-after", exc.retry_after)])
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

    def info(self) -> IngressInfo:
        return IngressInfo(pid=os.getpid(), replica=serve.get_replica_context().replica_id.unique_id)

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
        async for item in stream:
            if isinstance(item, (TokenEvent, tuple)):
                yield "".join(_sse(chunk_body(rid, self.model_name, created, e, chat)) for e in _events(item))
            elif isinstance(item, GenerationResult):
                yield _sse(final_chunk_body(rid, self.model_name, created, item, chat))
            elif isinstance(item, (Rejected, Failed)):  # after admission: report in-band
                yield _sse(error_body(item.message, "server_error"))
                break
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
        async for item in stream:
            if isinstance(item, (TokenEvent, tuple)):
                for event in _events(item):
                    yield pb_chunk(rid, event)
            elif isinstance(item, GenerationResult):
                yield pb_final_chunk(rid, item)
            elif isinstance(item, (Rejected, Failed)):
                _set_status(grpc_context, ServerFailure(item.message))
                raise ServerFailure(item.message)

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
        try:
            stream = self.router.generate.remote(request, tokens)
            first = await stream.__anext__()
        except BackPressureError as exc:  # Serve's queue for a SmallRouter replica is full
            retry = self.args.admission.retry_after_s if exc.retry_after_s is None else exc.retry_after_s
            raise Overload(exc.message, retry) from None
        if isinstance(first, Overloaded):  # the SmallRouter replica is full
            raise Overload(first.message, first.retry_after_s)
        if isinstance(first, Rejected):
            raise ClientError(first.message)
        if isinstance(first, Failed):
            raise ServerFailure(first.message)
        assert isinstance(first, Admitted), first
        return stream

