"""The Ingress's gRPC methods: the Backoff service of clients/wire/backoff.proto (Generate,
GenerateStream, Models, Health), as Ray Serve's gRPC proxy calls them on the Ingress
replica (deployments/serving/grpc_service.py registers the service). A request's checks
(its caller's key, a body that did not parse, its size, the model, its fields) happen here;
the limits, the client's slot and the SmallModels are the Ingress's `_open`, shared with
the HTTP routes. A refusal sets INVALID_ARGUMENT / NOT_FOUND / UNAUTHENTICATED /
RESOURCE_EXHAUSTED on the context (deployments/grpc_errors.py), a failure UNAVAILABLE or
INTERNAL.
"""

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from pydantic import ValidationError
from ray.serve.grpc_util import RayServegRPCContext

from backoff_core.types import GenerationResult, TokenEvent
from clients.wire import backoff_pb2 as pb
from clients.wire.errors import describe_validation
from clients.wire.proto import params_from_pb, prompt_from_pb
from deployments.grpc_errors import set_grpc_status
from deployments.serving.access import ClientError, Edge
from deployments.serving.completions import Echo, PbStream
from deployments.serving.formats import pb_response, request_line
from deployments.serving.grpc_service import Undecodable
from deployments.serving.outcomes import Admitted, Failed, Rejected
from deployments.streams import ServerFailure, collect, failure, request_log, token_events

log = logging.getLogger(__name__)


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return describe_validation(exc.errors())[1]
    return str(exc)


def _grpc_client(edge: Edge, context: RayServegRPCContext) -> str:
    """The caller's client id from its metadata (`authorization: Bearer <key>`); ClientError(401)."""
    authorization = next((v for k, v in context.invocation_metadata() if k == "authorization"), None)
    return edge.access.client(authorization, context.peer())


class GrpcMethods:
    """The gRPC half of the Ingress (a base of `ingress.Ingress`, which sets the attributes
    below in its __init__ and defines the two coroutines)."""

    edge: Edge
    model_name: str
    _open: Callable[..., Awaitable[list[tuple[Admitted, AsyncIterator]]]]  # Ingress._open
    _chain_ok: Callable[[], Awaitable[str]]  # '' when the chain answers, else why not

    async def Generate(
        self, request: pb.GenerateRequest | Undecodable, grpc_context: RayServegRPCContext
    ) -> pb.GenerateResponse:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        started = time.monotonic()
        try:
            admitted, stream = await self._open_pb(request_id, request, grpc_context, tokens=False)
            result = await collect(stream)
            request_log.info(request_line(request_id, [result], time.monotonic() - started))
            echo = Echo.of(admitted, result)
            return pb_response(request_id, result, None if echo is None else (echo.token_ids, echo.text))
        except Exception as exc:  # noqa: BLE001 - client errors, failures, and a bug as INTERNAL with a message
            if not isinstance(exc, (ClientError, ServerFailure)):
                log.exception("request %s: Generate failed", request_id)
            set_grpc_status(grpc_context, exc, request_id)
            return pb.GenerateResponse()

    async def GenerateStream(
        self, request: pb.GenerateRequest | Undecodable, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        started = time.monotonic()
        try:
            admitted, stream = await self._open_pb(request_id, request, grpc_context)
        except Exception as exc:  # noqa: BLE001 - as in Generate
            if not isinstance(exc, (ClientError, ServerFailure)):
                log.exception("request %s: GenerateStream failed", request_id)
            set_grpc_status(grpc_context, exc, request_id)
            raise  # nothing was streamed: Serve sends the status set above only with an exception
        out = PbStream(request_id, admitted, prompt_logprobs=request.HasField("logprobs"))
        try:
            for message in out.start():  # echo: the prompt first
                yield message
            async for item in stream:
                if isinstance(item, (TokenEvent, tuple)):
                    for message in out.tokens(token_events(item)):  # one message, as it came from the router
                        yield message
                elif isinstance(item, GenerationResult):
                    for message in out.finished(item):
                        yield message
                    request_log.info(request_line(request_id, [item], time.monotonic() - started))
                elif isinstance(item, (Rejected, Failed)):
                    raise failure(item)
        except Exception as exc:  # noqa: BLE001 - a ServerFailure, or a bug: INTERNAL with a message
            if not isinstance(exc, ServerFailure):
                log.exception("request %s: GenerateStream failed", request_id)
            set_grpc_status(grpc_context, exc, request_id)
            raise
        finally:
            await stream.aclose()

    async def Models(
        self, request: pb.ModelsRequest | Undecodable, grpc_context: RayServegRPCContext
    ) -> pb.ModelsResponse:
        try:
            _grpc_client(self.edge, grpc_context)
        except ClientError as exc:
            set_grpc_status(grpc_context, exc)
            return pb.ModelsResponse()
        return pb.ModelsResponse(models=[self.model_name])

    async def Health(
        self, request: pb.HealthRequest | Undecodable, grpc_context: RayServegRPCContext
    ) -> pb.HealthResponse:
        if not self.edge.access.health_open:
            try:
                _grpc_client(self.edge, grpc_context)
            except ClientError as exc:
                set_grpc_status(grpc_context, exc)
                return pb.HealthResponse()
        problem = await self._chain_ok()
        return pb.HealthResponse(ok=not problem, detail=problem or "ok")

    async def _open_pb(
        self,
        request_id: str,
        request: pb.GenerateRequest | Undecodable,
        context: RayServegRPCContext,
        tokens: bool = True,
    ) -> tuple[Admitted, AsyncIterator]:
        client = _grpc_client(self.edge, context)  # first: an unknown caller learns nothing else
        if isinstance(request, Undecodable):
            raise ClientError(request.describe())
        size = request.ByteSize()
        if size > self.edge.limits.max_body_bytes:
            raise ClientError(
                f"the request is {size} bytes; the limit is {self.edge.limits.max_body_bytes} (limits.max_body_bytes)",
                code="request_too_large",
            )
        if request.model and request.model != self.model_name:
            raise ClientError(f"model {request.model!r} is not served here", "model", 404, "model_not_found")
        try:
            params = params_from_pb(request)
            prompt, messages = prompt_from_pb(request)
        except (ValidationError, ValueError) as exc:
            raise ClientError(_first_error(exc)) from None
        content = {"messages": messages} if messages is not None else {"prompt": prompt}
        return (await self._open(request_id, params, client, tokens, [content]))[0]
