"""Every transport's failures become these exceptions, here and nowhere else."""

from __future__ import annotations

import json


class BackoffError(Exception):
    """Base class. `status` is the HTTP status or the gRPC status code name."""

    def __init__(self, message: str, status: int | str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


class BadRequestError(BackoffError, ValueError):
    """The server refused the request's content (HTTP 4xx, gRPC INVALID_ARGUMENT)."""


class NotFoundError(BackoffError):
    """Unknown route, model or method (HTTP 404, gRPC NOT_FOUND / UNIMPLEMENTED)."""


class ServerError(BackoffError):
    """The server failed while serving (HTTP 5xx, gRPC INTERNAL / UNKNOWN)."""


class TransportError(BackoffError):
    """No answer: connection refused, timeout, server unavailable."""


def from_http(status: int, body: bytes | str) -> BackoffError:
    """An HTTP error response -> exception (reads the OpenAI-style {"error": {...}} body)."""
    message, param = _error_message(body), None
    try:
        detail = json.loads(body)["error"]
        message, param = detail.get("message") or message, detail.get("param")
    except (ValueError, KeyError, TypeError):
        pass
    if status == 404:
        return NotFoundError(message, status, param)
    if 400 <= status < 500:
        return BadRequestError(message, status, param)
    if status in (502, 503, 504):
        return TransportError(message, status, param)
    return ServerError(message, status, param)


def from_event(body: dict) -> BackoffError:
    """An in-band error event of an SSE stream (its 200 already sent) -> exception: a
    `*_unavailable` code (a part of the chain went down) reads as a 503, else a 500."""
    detail = body.get("error") or {}
    unavailable = str(detail.get("code") or "").endswith("unavailable")
    return from_http(503 if unavailable else 500, json.dumps(body))


def from_grpc(error) -> BackoffError:
    """A grpc.RpcError -> exception (grpc is imported lazily: HTTP users need not have it)."""
    import grpc

    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = (error.details() if hasattr(error, "details") else None) or str(error)
    name = code.name if code is not None else "UNKNOWN"
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.FAILED_PRECONDITION):
        return BadRequestError(message, name)
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
        return NotFoundError(message, name)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return TransportError(message, name)
    return ServerError(message, name)


def from_validation(error) -> BadRequestError:
    """A request the client itself refuses (pydantic ValidationError) -> BadRequestError."""
    first = error.errors()[0] if hasattr(error, "errors") and error.errors() else {}
    param = ".".join(str(x) for x in first.get("loc", ())) or None
    message = f"{param}: {first.get('msg')}" if first else str(error)
    return BadRequestError(message, None, param)


def from_transport(error: Exception) -> BackoffError:
    """A client library's connection / timeout exception -> TransportError."""
    return TransportError(f"{type(error).__name__}: {error}")


def _error_message(body: bytes | str) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return text.strip()[:500] or "no error message"
