"""Errors raised in Ray Serve's HTTP proxy's own path, in the OpenAI error shape (issue 56).

Our Ingress answers every refusal and failure as JSON (http_errors.py), but some answers never
reach it or never come back from it; Ray Serve 2.60's proxy (serve/_private/proxy.py,
http_util.get_http_response_status) then answers in text of its own:
- 408 `Request <id> timed out after <s>s.`: http_options.request_timeout_s passed;
- 503 Serve's backpressure text (a deployment's max_queued_requests full; Retry-After kept)
  or `DeploymentUnavailableError`'s (an app being deleted or not yet running);
- nothing at all for any other error between the proxy and the Ingress (a replica that died
  mid-request, an answer past the channel's message cap): the proxy returns without a
  response and uvicorn sends a 21-byte plain-text `500 Internal Server Error`;
- 404 `Path '/v1/...' not found.` while no application routes the path: in the first seconds
  of a start, before the Ingress runs (it answers its own 404s in JSON). For the API's paths
  (/v1/) that is a 503 `not_ready` + Retry-After, as the Ingress answers until every replica
  is up (deployments/serving/readiness.py), with the other cause named (no app at that route
  prefix: GET /-/routes lists them); other paths get a JSON 404.
`ProxyErrors` wraps the proxy's ASGI app (Serve's hook: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
= "deployments.proxy_errors:proxy_middlewares", in the nodes' environment: serve_cli.SERVE_PATH_ENV,
cluster.yaml) and turns each into a JSON error with a `type`, a `code` and a message written
for the client; Serve's text goes to the proxy's log under the error id the message names.
A response that is JSON already (the Ingress's) or not an error passes untouched, one that has
started cannot be changed (an SSE stream reports in-band), and a client that disconnected (a
499: the proxy answers nothing) is sent nothing.

Ray Serve 2.60's gRPC proxy has no such hook (grpc_util.gRPCGenericServer builds its server with
interceptors=()). When the call to the Ingress raises, gRPCProxy.send_request_to_replica makes the
call's status with grpc_util.get_grpc_response_status, imported by name into proxy.py: INTERNAL
carries str(exc), for a replica lost under the call str(RayActorError) (actor ids, the node's
address: ray-project/ray#58851), and the other codes Serve's own text. The callback also runs
`install_grpc()`, in the proxy actor's process, which is the gRPC proxy's too, before that proxy
is built: it wraps that name in proxy.py's namespace (the narrowest seam), keeps the code Serve
chose and replaces the details with the sentences above and the request id, Serve's detail going
to the log under that id. A status the Ingress set itself (a gRPCStatusError with details:
deployments/grpc_errors.py's words) and a client's cancel pass untouched. If the Ray version's
internals differ, Serve's words stay, one warning is logged and the proxy starts as before
(tests/deployments/serving/test_proxy_grpc_errors.py pins the seam to the installed Ray).

Imported by every proxy at start: the standard library and Ray's own modules alone (no torch, no
pydantic models).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import re
import uuid

log = logging.getLogger("ray.serve")


def proxy_middlewares() -> list:
    """Serve's HTTP proxy callback: the middlewares it wraps its ASGI app in."""
    from starlette.middleware import Middleware  # Serve's own dependency; the proxy has it

    install_grpc()  # the same process runs the gRPC proxy, which has no hook of its own
    return [Middleware(ProxyErrors)]


def _body(message: str, code: str) -> bytes:
    """The OpenAI error body (formats.error_body's shape, without importing the app's models)."""
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}}).encode()


NOT_READY_RETRY_AFTER_S = 1  # what the Ingress's not_ready answers say (admission.retry_after_s's default)


def rewrite(status: int, text: str, error_id: str, path: str = "") -> tuple[int, bytes]:
    """(status, JSON body) for Serve's own answer `text` with `status` to a request for `path`."""
    status, message, code = client_error(status, text, error_id, path)
    return status, _body(message, code)


def client_error(status: int, text: str, error_id: str, path: str = "") -> tuple[int, str, str]:
    """(status, message for the client, code) for Serve's own answer `text` with `status`
    (the gRPC proxy's statuses are worded with it too: grpc_details)."""
    if status == 404:
        if path.startswith("/v1/"):
            message = (
                f"no application serves {path} yet: the server is starting (retry after the Retry-After "
                "header's seconds), or no app is deployed at that route prefix (GET /-/routes lists them)"
            )
            return 503, message, "not_ready"
        return 404, f"no route {path} (GET /-/routes lists the applications' route prefixes)", "not_found"
    if status == 408:
        after = re.search(r"after ([0-9.]+)s", text)
        limit = f" ({float(after.group(1)):g} s)" if after else ""
        message = f"the request took longer than the server's request timeout{limit}; ask for fewer tokens or retry"
        return 408, message, "request_timeout"
    if status == 503:
        if "backpressure" in text.lower() or "queued" in text.lower():
            return 503, "the server is overloaded: too many requests are queued; retry later", "overloaded"
        return 503, "the model is not available right now (starting, or being redeployed); retry later", "unavailable"
    message = f"the server failed while handling this request (request {error_id}: the server's log has the detail)"
    return (status if status >= 500 else 500), f"{message}; retrying may work", "internal_error"


def _is_servers_text(message: dict) -> bool:
    """Whether a response start is Serve's own error (not JSON): a 5xx, a 408 or a 404."""
    status = int(message.get("status", 200))
    if status < 500 and status not in (408, 404):
        return False
    headers = {k.lower(): v for k, v in message.get("headers", ())}
    return not headers.get(b"content-type", b"").startswith(b"application/json")


class ProxyErrors:
    """Pure ASGI middleware around the proxy (see the module doc)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path", "").startswith("/-/"):  # Serve's own routes
            return await self.app(scope, receive, send)
        started = gone = False
        held: dict | None = None  # Serve's error start, held until its body is read
        body = b""

        async def listen():
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def watch(message) -> None:
            nonlocal started, held, body
            if message["type"] == "http.response.start" and _is_servers_text(message):
                held = message
                return
            if held is not None and message["type"] == "http.response.body":
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    await self._answer(send, held, body.decode("utf-8", "replace"), scope.get("path", ""))
                    started = True
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, listen, watch)
        except Exception:  # noqa: BLE001 - answered in the OpenAI shape, its detail in the log alone
            if started:
                raise
            log.exception("proxy: request to %s failed before any answer", scope.get("path"))
            await self._answer(send, {"status": 500, "headers": []}, "")
            return
        if not started and not gone:  # the proxy gave up with no answer (uvicorn: its plain text)
            await self._answer(send, {"status": 500, "headers": []}, f"no answer from the app for {scope.get('path')}")

    @staticmethod
    async def _answer(send, start: dict, text: str, path: str = "") -> None:
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        status, body = rewrite(int(start["status"]), text, error_id, path)
        log.warning("proxy: request %s answered %d, Serve's text %r", error_id, status, text[:500])
        kept = [(k, v) for k, v in start.get("headers", ()) if k.lower() in (b"retry-after", b"x-request-id")]
        if status == 503 and int(start["status"]) == 404:  # not ready: when to come back, as the Ingress says
            kept.append((b"retry-after", str(NOT_READY_RETRY_AFTER_S).encode()))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *kept]
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        except Exception:  # noqa: BLE001 - the client went away (a 499): nothing to answer
            log.debug("proxy: request %s: the client is gone", error_id)


# -- the gRPC proxy (no hook: its exception -> status function, wrapped) ---------------------

SEAM = "ray.serve._private.proxy.get_grpc_response_status"
PARAMETERS = ["exc", "request_timeout_s", "request_id"]
# Serve's gRPC code -> the HTTP status its HTTP proxy answers for the same cause (else 500)
HTTP_STATUS = {"DEADLINE_EXCEEDED": 408, "RESOURCE_EXHAUSTED": 503, "UNAVAILABLE": 503}


def grpc_details(code_name: str, exc: BaseException, request_id: str, serves_text: str) -> str:
    """What a client is told for a status Serve's gRPC proxy made of exc (no exception text)."""
    from ray.exceptions import RayActorError  # the proxy has Ray loaded

    if isinstance(exc, RayActorError):  # the Ingress replica serving the call died or went away
        where = f"request {request_id}: the server's log has the detail"
        return f"the server's replica handling this request was lost ({where}); retrying may work"
    http_status = HTTP_STATUS.get(code_name, 500)
    _, message, _ = client_error(http_status, serves_text, request_id)
    return message if http_status == 500 else f"{message} (request {request_id})"


def grpc_status(status, exc: BaseException, request_id: str):
    """Serve's ResponseStatus for exc with its details written for the client (the code kept)."""
    from ray.serve._private.proxy_request_response import ResponseStatus
    from ray.serve.exceptions import gRPCStatusError

    code_name = getattr(status.code, "name", str(status.code))
    if not status.is_error or code_name in ("OK", "CANCELLED"):
        return status
    if isinstance(exc, gRPCStatusError) and exc.grpc_details:  # the Ingress's own words (grpc_errors.py)
        return status
    cause = getattr(exc, "original_exception", exc)  # a gRPCStatusError without details wraps Ray's
    details = grpc_details(code_name, cause, request_id, status.message)
    log.warning("proxy: gRPC request %s answered %s; Serve's detail: %r", request_id, code_name, status.message[:2000])
    return ResponseStatus(code=status.code, is_error=True, message=details)


def _wrap(original):
    def get_grpc_response_status(exc, request_timeout_s, request_id):
        status = original(exc, request_timeout_s, request_id)
        try:
            return grpc_status(status, exc, request_id)
        except Exception:  # noqa: BLE001 - never lose the call's status to a bug here
            log.exception("proxy: gRPC request %s: rewriting its status failed; Serve's detail: %r", request_id, exc)
            if not status.is_error:
                return status
            where = f"request {request_id}: the server's log has the detail"
            return dataclasses.replace(status, message=f"the server failed ({where}); retrying may work")

    get_grpc_response_status.backoff_original = original
    return get_grpc_response_status


def install_grpc() -> bool:
    """Wrap Serve's gRPC proxy's exception -> status function; False (one warning) if it moved."""
    try:
        from ray.serve._private import proxy

        original = proxy.get_grpc_response_status
        if getattr(original, "backoff_original", None) is not None:
            return True  # installed already (the callback ran again in this process)
        if list(inspect.signature(original).parameters) != PARAMETERS:
            raise TypeError(f"{SEAM} takes {list(inspect.signature(original).parameters)}, not {PARAMETERS}")
        proxy.get_grpc_response_status = _wrap(original)
        return True
    except Exception as exc:  # noqa: BLE001 - a Ray whose internals differ: the proxy starts as before
        log.warning("proxy: gRPC errors keep Serve's own details (%s not found as expected in this Ray: %s)", SEAM, exc)
        return False
