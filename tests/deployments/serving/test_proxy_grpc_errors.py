"""Serve's gRPC proxy's own statuses in words for the client (deployments/proxy_errors.py),
through Ray Serve 2.60's real gRPCProxy.send_request_to_replica with a handle whose call raises
as a lost or refusing Ingress does (no Ray started): the code Serve chose is kept, the details
carry no exception text (actor ids, the node's address, Python reprs) and name the request id,
under which the proxy's log has Serve's detail. The seam is pinned to the installed Ray."""

from __future__ import annotations

import asyncio
import inspect
import logging
import re

import grpc
import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve._private import grpc_util, proxy
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, gRPCStatusError

from deployments import proxy_errors
from deployments.proxy_errors import ProxyErrors, proxy_middlewares

ACTOR_ID = "8f" * 16
LOST = ActorUnavailableError(f"The actor {ACTOR_ID[:8]} is unavailable: node 10.1.2.3 died", bytes.fromhex(ACTOR_ID))
# what must never reach a client: Ray's exception names and reprs, ids, addresses, Serve's own text
INTERNAL = re.compile(
    r"RayActorError|ActorID|Actor(Died|Unavailable)Error|[0-9a-f]{12,}|\d+\.\d+\.\d+\.\d+|<|\w+Error\(|"
    r"Received message|backpressure|timed out|Deployment '"
)


@pytest.fixture
def installed(monkeypatch):
    """proxy_errors.install_grpc() done in this process, Serve's own function back afterwards."""
    monkeypatch.setattr(proxy, "get_grpc_response_status", grpc_util.get_grpc_response_status)
    assert proxy_errors.install_grpc()
    return proxy.get_grpc_response_status


@pytest.fixture
def proxy_log():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ray.serve")  # Serve's logger does not propagate to the root
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


class _Response:
    """A DeploymentResponse whose result raises exc (what the proxy awaits for a unary call)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __await__(self):
        raise self.exc
        yield  # makes this a generator

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> None:
        pass


class _Handle:
    deployment_name, app_name = "Ingress", "backoff"

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def remote(self, arg) -> _Response:
        return _Response(self.exc)


class _Request:  # a unary gRPCProxyRequest's fields send_request_to_replica reads
    has_input_stream, request_type, method, context = False, "grpc", "/backoff.Backoff/Generate", None

    def serialized_replica_arg(self) -> bytes:
        return b""


def status_for(exc: BaseException, timeout_s: float | None = 5.0):
    """The final ResponseStatus Serve's gRPC proxy yields when the call to the Ingress raises exc."""

    async def go():
        grpc_proxy = proxy.gRPCProxy(
            node_id="n1", node_ip_address="10.1.2.3", is_head=True, proxy_router=None, request_timeout_s=timeout_s
        )
        return [m async for m in grpc_proxy.send_request_to_replica("req-4f2a", "int-1", _Handle(exc), _Request())]

    (status,) = asyncio.run(go())
    return status


def test_the_seam_is_where_the_installed_ray_has_it(monkeypatch):
    """An upgrade that moves it fails here, not silently in production. (Another module's
    test may have run the proxy callback in this process: Ray's function is then under ours.)"""
    found = proxy.get_grpc_response_status
    assert getattr(found, "backoff_original", found) is grpc_util.get_grpc_response_status
    monkeypatch.setattr(proxy, "get_grpc_response_status", grpc_util.get_grpc_response_status)  # Serve's words
    assert list(inspect.signature(grpc_util.get_grpc_response_status).parameters) == proxy_errors.PARAMETERS
    source = inspect.getsource(proxy.gRPCProxy)
    assert source.count("get_grpc_response_status(e, self.request_timeout_s, request_id)") == 3
    assert "get_grpc_response_status" not in inspect.getsource(proxy.HTTPProxy)
    # and what it fixes: Serve's own words for a lost replica name the actor and the node
    assert ACTOR_ID in status_for(LOST).message and "10.1.2.3" in status_for(LOST).message


@pytest.mark.parametrize(
    "exc, code, says",
    [
        (LOST, "INTERNAL", "replica handling this request was lost"),
        (ActorDiedError(), "INTERNAL", "replica handling this request was lost"),
        (RayActorError(), "INTERNAL", "replica handling this request was lost"),
        (RuntimeError("<AioRpcError Received message larger than max (11600129 vs. 4194304)>"), "INTERNAL", "failed"),
        (TimeoutError(), "DEADLINE_EXCEEDED", "request timeout (5 s)"),
        (BackPressureError(4, 4), "RESOURCE_EXHAUSTED", "overloaded"),
        (DeploymentUnavailableError(DeploymentID("Ingress", "backoff")), "UNAVAILABLE", "not available"),
        (
            gRPCStatusError(LOST, grpc.StatusCode.UNAVAILABLE, ""),
            "UNAVAILABLE",
            "replica handling this request was lost",
        ),
    ],
)
def test_serves_own_statuses_keep_their_code_and_lose_their_text(installed, proxy_log, exc, code, says):
    status = status_for(exc)
    assert status.is_error and status.code.name == code and says in status.message, status
    assert "(request req-4f2a" in status.message  # the id the proxy's log line names
    assert not INTERNAL.search(status.message), status.message
    (line,) = [r.getMessage() for r in proxy_log if "proxy: gRPC request req-4f2a" in r.getMessage()]
    assert code in line
    if exc is LOST:
        assert ACTOR_ID in line and "10.1.2.3" in line  # the whole detail, on the server


def test_the_ingresss_statuses_and_a_clients_cancel_pass_untouched(installed):
    ours = gRPCStatusError(RuntimeError("x"), grpc.StatusCode.UNAVAILABLE, "the small router is unavailable")
    assert status_for(ours).message == "the small router is unavailable"
    cancelled = status_for(asyncio.CancelledError())
    assert (
        cancelled.code == grpc.StatusCode.CANCELLED
        and cancelled.message == grpc_util.get_grpc_response_status(asyncio.CancelledError(), 5.0, "req-4f2a").message
    )


def test_serves_http_proxy_callback_installs_it_once(monkeypatch):
    monkeypatch.setattr(proxy, "get_grpc_response_status", grpc_util.get_grpc_response_status)
    (middleware,) = proxy_middlewares()
    wrapped = proxy.get_grpc_response_status
    assert middleware.cls is ProxyErrors and wrapped.backoff_original is grpc_util.get_grpc_response_status
    proxy_middlewares()  # the callback again in the same process: not wrapped twice
    assert proxy.get_grpc_response_status is wrapped


def test_a_ray_whose_internals_differ_still_starts_the_proxy_with_one_warning(monkeypatch, proxy_log):
    monkeypatch.setattr(proxy, "get_grpc_response_status", lambda exc, timeout_s: None)  # another signature
    (middleware,) = proxy_middlewares()
    assert middleware.cls is ProxyErrors
    assert proxy.get_grpc_response_status.__name__ == "<lambda>"  # left as it was
    (warning,) = [r for r in proxy_log if r.levelno == logging.WARNING]
    assert proxy_errors.SEAM in warning.getMessage()
    monkeypatch.delattr(proxy, "get_grpc_response_status")
    assert not proxy_errors.install_grpc()


def test_a_bug_in_the_wording_keeps_the_code_and_still_hides_the_text(installed, monkeypatch):
    def broken(*args):
        raise KeyError("wording")

    monkeypatch.setattr(proxy_errors, "grpc_details", broken)
    status = status_for(LOST)
    assert status.code == grpc.StatusCode.INTERNAL and "(request req-4f2a" in status.message
    assert not INTERNAL.search(status.message), status.message
