"""What a request's stream carries besides its tokens and result, and the one mapping of the
errors that refuse or end a request to those items. Imports no torch: the Ingress reads these
records and never loads a model stack (deployments/serving/engine_loop.py produces them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from backoff_core.errors import KVCapacityError, LargeUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admitted:
    request_id: str
    prompt_tokens: int
    prompt_ids: tuple[int, ...] | None = None  # an echo request's (ServeRequest.echo)
    prompt_text: str | None = None  # their text, added by the SmallModel


@dataclass(frozen=True)
class Rejected:
    """The request's content was refused (ValueError): a client error."""

    message: str


@dataclass(frozen=True)
class Failed:
    """Serving failed (not the client's fault)."""

    message: str
    unavailable: bool = False  # a part of the chain is down or too slow: retrying later may work
    code: str = "large_unavailable"  # with unavailable: what is missing (kv_capacity: no free KV slot)


def error_item(exc: Exception, admitted: bool, request_id: str = "") -> Rejected | Failed:
    """What the caller of a request is told of the error that refused it (admitted=False) or
    ended it alone (True): the one mapping of errors to stream items. A ValueError at
    admission is the request's content (Rejected, a 400); once admitted, any error is ours."""
    if isinstance(exc, ValueError) and not admitted:
        return Rejected(str(exc))
    if isinstance(exc, KVCapacityError):  # every KV slot is taken (M_S's, or a larger model's): retry later
        log.warning("request %s: %s", request_id or "refused", exc)
        return Failed(str(exc), unavailable=True, code="kv_capacity")
    if isinstance(exc, LargeUnavailable):  # a larger model did not answer (scoring a prompt; on_large_failure "fail")
        return Failed(str(exc), unavailable=True)
    if admitted:  # this request's own failure; the others go on
        log.warning("request %s failed: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc)
    else:
        log.error("request %s: admission failed", request_id or "?", exc_info=exc)
    # the exception's text (a gRPC status string, a repr) is for the server's log, not the client
    return Failed(internal_message(request_id), code="internal_error")


def internal_message(request_id: str = "") -> str:
    """What a client is told of a failure inside the server: no exception text (that goes to
    the log, under the request id the message names)."""
    where = f" (request {request_id}: the server's log has the detail)" if request_id else ""
    return f"the server failed while handling this request{where}; retrying may work"
