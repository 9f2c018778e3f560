"""Serve's HTTP proxy's own answers in the OpenAI error shape (deployments/proxy_errors.py): a
stand-in proxy app answers each failure as Ray Serve 2.60's proxy does (its own
http_util.get_http_response_status and send_http_response_on_exception, no Ray started), and
ProxyErrors around it gives every client a JSON error with a type, a code and no Serve text;
the Ingress's own JSON errors and streams pass untouched; a client that left is sent nothing."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from ray.exceptions import RayActorError
from ray.serve._private.common import DeploymentID
from ray.serve._private.http_util import (
    get_http_response_status,
    send_http_response_on_exception,
    validate_http_proxy_callback_return,
)
from ray.serve._private.utils import call_function_from_import_path
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deployments import serve_cli
from deployments.proxy_errors import ProxyErrors

SERVE_WORDS = ("Request ", "backpressure", "Internal Server Error", "failed to deploy", "RayActorError", "timed out")


def proxy_failing_with(exc: BaseException, timeout_s: float | None = 5.0):
    """An ASGI app answering as Serve's HTTP proxy does when the call to the Ingress raises exc."""

    async def app(scope, receive, send):
        status = get_http_response_status(exc, timeout_s, "4f2a")
        for message in send_http_response_on_exception(status, response_started=False):
            await send(message)

    return app


def _post(app) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=ProxyErrors(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.post("/v1/completions", json={"prompt": "w3"})

    return asyncio.run(go())


def _error(response: httpx.Response) -> dict:
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert not any(w in error["message"] for w in SERVE_WORDS), error["message"]
    return error


@pytest.mark.parametrize(
    "exc, status, code, says",
    [
        (TimeoutError(), 408, "request_timeout", "request timeout (5 s)"),
        (BackPressureError(4, 4, retry_after_s=2.0), 503, "overloaded", "too many requests are queued"),
        (DeploymentUnavailableError(DeploymentID("Ingress", "default")), 503, "unavailable", "not available"),
        # a replica that died mid-request, an answer past the channel's cap: Serve sends nothing
        (RayActorError(), 500, "internal_error", "the server failed"),
        (RuntimeError("Received message larger than max (11600129 vs. 4194304)"), 500, "internal_error", "failed"),
    ],
)
def test_each_of_serves_own_answers_is_an_openai_error(exc, status, code, says):
    response = _post(proxy_failing_with(exc))
    assert response.status_code == status
    error = _error(response)
    assert error["code"] == code and says in error["message"]
    if isinstance(exc, BackPressureError):
        assert response.headers["retry-after"] == "2"
    if status == 500:
        assert "(request err-" in error["message"]  # the id the proxy's log line names


def test_an_app_that_raises_before_answering_is_a_json_500():
    async def app(scope, receive, send):
        raise RuntimeError("boom: <internal repr>")

    response = _post(app)
    assert response.status_code == 500 and _error(response)["code"] == "internal_error"
    assert "boom" not in response.text


def test_the_ingresss_answers_pass_untouched():
    body = json.dumps({"error": {"message": "M_L is unavailable", "type": "server_error", "param": None, "code": "x"}})

    async def json_500(scope, receive, send):
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})

    response = _post(json_500)
    assert response.status_code == 503 and response.text == body

    async def stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for chunk in (b"data: 1\n\n", b"data: [DONE]\n\n"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    response = _post(stream)
    assert response.status_code == 200 and response.text == "data: 1\n\ndata: [DONE]\n\n"


def test_the_proxys_404_before_the_ingress_runs_is_a_503_not_ready_on_the_api():
    """Serve's proxy answers 404 in text while no app routes a path (a start's first seconds,
    before the Ingress runs): on the API's paths a 503 `not_ready` + Retry-After, as the
    Ingress answers until its replicas are up; elsewhere a JSON 404. The Ingress's own JSON
    404s pass untouched."""

    async def no_route(scope, receive, send):  # the proxy's not_found_response
        text = f"Path '{scope['path']}' not found. Ping http://.../-/routes for available routes."
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": text.encode()})

    response = _post(no_route)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    error = _error(response)
    assert error["code"] == "not_ready" and "starting" in error["message"] and "/-/routes" in error["message"]

    async def get(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=ProxyErrors(no_route))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.get(path)

    other = asyncio.run(get("/favicon.ico"))
    assert other.status_code == 404 and _error(other)["code"] == "not_found" and "retry-after" not in other.headers

    body = json.dumps({"error": {"message": "model nope", "type": "invalid_request_error", "param": None, "code": "x"}})

    async def ingress_404(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})

    assert _post(ingress_404).text == body


def test_a_client_that_left_is_sent_nothing():
    sent = []

    async def app(scope, receive, send):
        assert (await receive())["type"] == "http.disconnect"  # the proxy then answers nothing (499)

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(ProxyErrors(app)({"type": "http", "path": "/v1/completions"}, receive, send))
    assert sent == []


def test_serves_proxies_load_the_middleware_from_the_nodes_environment():
    path = serve_cli.SERVE_PATH_ENV["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]
    (middleware,) = validate_http_proxy_callback_return(call_function_from_import_path(path))
    assert middleware.cls is ProxyErrors
