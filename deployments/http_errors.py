"""The HTTP edge's errors in the OpenAI shape: pydantic and Starlette refusals, our client
errors, overload and server failures, and any exception no handler took (a 500, never
Starlette's plain-text page)."""

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY

from clients.wire.errors import describe_validation
from deployments.serving.access import ClientError, body_too_large
from deployments.serving.formats import error_body
from deployments.serving.outcomes import internal_message
from deployments.streams import OverloadedError, ServerFailure

log = logging.getLogger(__name__)


def error_response(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None, headers: dict | None = None
):
    # a message may quote client text with lone surrogates, which UTF-8 cannot encode
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        error = errors[0]
        message = f"the body is not valid JSON: {error.get('ctx', {}).get('error', 'decode error')}"
        return error_response(400, f"{message} at position {error['loc'][-1]}", "invalid_request_error")
    param, message = describe_validation(errors)
    return error_response(400, message, "invalid_request_error", param)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own refusals (unknown route, wrong method, a body that is not
    UTF-8 or too large) in the OpenAI error shape."""
    message, code = str(exc.detail), None
    if exc.status_code == 413:  # a streamed body went past the limit
        too_large = body_too_large(request.scope.get(MAX_BODY_SIZE_SCOPE_KEY))
        message, code = too_large.message, too_large.code
    elif exc.status_code == 400 and message == "There was an error parsing the body":
        message = "the body could not be read as JSON (is it UTF-8?)"
    return error_response(exc.status_code, message, "invalid_request_error", None, code, exc.headers)


async def _client_error(request: Request, exc: ClientError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.kind, exc.param, exc.code, exc.headers)


async def _overload(request: Request, exc: OverloadedError) -> JSONResponse:
    return error_response(
        exc.status, exc.message, "server_error", code=exc.code, headers={"Retry-After": exc.retry_after}
    )


async def _server_failure(request: Request, exc: ServerFailure) -> JSONResponse:
    return error_response(exc.status, exc.message, "server_error", code=exc.code)


class InternalErrors:
    """An exception no handler took becomes a 500 with the OpenAI error body, never
    Starlette's plain-text `Internal Server Error` (outermost of our middlewares; a
    response already started cannot be changed, and an SSE stream reports in-band)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:  # noqa: BLE001 - answered in the OpenAI shape, its detail in the log alone
            error_id = f"err-{uuid.uuid4().hex[:16]}"
            log.exception("request %s: unhandled error in %s", error_id, scope.get("path"))
            if started:
                raise
            await error_response(500, internal_message(error_id), "server_error", code="internal_error")(
                scope, receive, send
            )


def install_http_errors(app: FastAPI) -> None:
    """Every refusal and failure of `app` answered in the OpenAI error shape (call it after the
    app's other middlewares: InternalErrors must be the outermost)."""
    app.add_middleware(InternalErrors)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientError, _client_error)
    app.add_exception_handler(OverloadedError, _overload)
    app.add_exception_handler(ServerFailure, _server_failure)
