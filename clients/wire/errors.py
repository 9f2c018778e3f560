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


class AuthenticationError(BackoffError):
    """No API key, or a wrong one (HTTP 401, gRPC UNAUTHENTICATED)."""


class NotFoundError(BackoffError):
    """Unknown route, model or method (HTTP 404, gRPC NOT_FOUND / UNIMPLEMENTED)."""


class ServerError(BackoffError):
    """The server failed while serving (HTTP 5xx, gRPC INTERNAL / UNKNOWN)."""


class TransportError(BackoffError):
    """No answer: connection refused, timeout, server unavailable."""


class OverloadedError(TransportError):
    """The server is at capacity and refused the request before starting it (HTTP 503,
    gRPC RESOURCE_EXHAUSTED): safe to send again, after `retry_after_s` when the server said."""

    def __init__(
        self,
        message: str,
        status: int | str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, status, param)
        self.retry_after_s = retry_after_s


class RateLimitError(OverloadedError):
    """This client has too many requests open (HTTP 429; over gRPC the same
    RESOURCE_EXHAUSTED as an overload, so an OverloadedError there)."""


def from_http(status: int, body: bytes | str, retry_after: str | None = None) -> BackoffError:
    """An HTTP error response -> exception (reads the OpenAI-style {"error": {...}} body and,
    for 503 / 429, the Retry-After header)."""
    message, param = _error_message(body), None
    try:
        detail = json.loads(body)["error"]
        message, param = detail.get("message") or message, detail.get("param")
    except (ValueError, KeyError, TypeError):
        pass
    if status == 404:
        return NotFoundError(message, status, param)
    if status == 401:
        return AuthenticationError(message, status, param)
    if status == 429:
        return RateLimitError(message, status, param, _seconds(retry_after))
    if status == 503:
        return OverloadedError(message, status, param, _seconds(retry_after))
    if 400 <= status < 500:
        return BadRequestError(message, status, param)
    if status in (502, 504):
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
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION):
        return BadRequestError(message, name)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(message, name)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        trailing = dict(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else {}
        return OverloadedError(message, name, retry_after_s=_seconds(trailing.get("retry-after")))
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
        return NotFoundError(message, name)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return TransportError(message, name)
    return ServerError(message, name)


def from_validation(error) -> BadRequestError:
    """A request the client itself refuses (pydantic ValidationError) -> BadRequestError."""
    param, message = describe_validation(error.errors()) if hasattr(error, "errors") else (None, str(error))
    return BadRequestError(message, None, param)


# pydantic names the branch of a union in an error's location ("constrained-str",
# "list[constrained-int]", "float"); those are not fields
_UNION_BRANCHES = ("float", "int", "str", "bool")


def _field_path(loc) -> str:
    parts = [str(x) for x in loc if x != "body"]
    return ".".join(p for p in parts if p not in _UNION_BRANCHES and not any(c in p for c in "-[]"))


def describe_validation(errors: list[dict]) -> tuple[str | None, str]:
    """pydantic errors -> (param, message) about the first field that failed. For a union
    (a prompt is text or token ids) the branch whose type matched explains the problem;
    when none matched, the message lists what the field may be."""
    if not errors:
        return None, "invalid request"
    field = _field_path(errors[0].get("loc", ())).split(".")[0]
    same = [e for e in errors if _field_path(e.get("loc", ())).split(".")[0] == field]
    matched = [e for e in same if not str(e.get("type", "")).endswith("_type")]
    if matched:
        param, message = _field_path(matched[0].get("loc", ())), matched[0].get("msg", "invalid")
    else:
        param = _field_path(errors[0].get("loc", ()))
        message = " or ".join(
            dict.fromkeys(e.get("msg", "invalid") for e in same if _field_path(e.get("loc", ())) == param)
        )
    return param or None, f"{param}: {message}" if param else message


def from_transport(error: Exception) -> BackoffError:
    """A client library's connection / timeout exception -> TransportError."""
    return TransportError(f"{type(error).__name__}: {error}")


def _seconds(value) -> float | None:
    """A Retry-After value in delay-seconds (the HTTP-date form is not used here)."""
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return None


def _error_message(body: bytes | str) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return text.strip()[:500] or "no error message"
