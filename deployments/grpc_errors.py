"""The gRPC edge's errors as statuses: our client errors (their HTTP status mapped, anything
else 4xx INVALID_ARGUMENT), overload (RESOURCE_EXHAUSTED with its retry-after), an unavailable
chain (UNAVAILABLE) and any other failure (INTERNAL); http_errors.py is the HTTP edge's twin."""

from __future__ import annotations

import grpc
from ray.serve.grpc_util import RayServegRPCContext

from deployments.serving.access import ClientError
from deployments.serving.outcomes import internal_message
from deployments.streams import OverloadedError, ServerFailure

# HTTP status of a client error -> its gRPC status (anything else 4xx: INVALID_ARGUMENT)
GRPC_CODES = {
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def set_grpc_status(context: RayServegRPCContext, exc: Exception, request_id: str = "") -> None:
    """exc as the call's status; a failure no handler wrote a message for (a bug) says only
    that the server failed and under which request id its log has the detail."""
    if isinstance(exc, ClientError):
        context.set_code(GRPC_CODES.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT))
        context.set_details(exc.message)
        if exc.headers.get("Retry-After"):
            context.set_trailing_metadata([("retry-after", exc.headers["Retry-After"])])
    elif isinstance(exc, OverloadedError):
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details(str(exc))
        # reaches the client on unary calls; Serve's proxy drops it when a stream raises
        context.set_trailing_metadata([("retry-after", exc.retry_after)])
    elif isinstance(exc, ServerFailure) and exc.status == 503:
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details(exc.message)
    else:
        context.set_code(grpc.StatusCode.INTERNAL)
        internal = not isinstance(exc, ServerFailure)  # a bug: its text is for the log, not the client
        context.set_details(internal_message(request_id) if internal else exc.message)
