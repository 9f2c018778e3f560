"""The client's retry policy (clients/retry.py): only refusals for lack of capacity are sent
again, a bounded number of times, after the server's Retry-After or an exponential wait, never
longer than max_wait_s (jitter only stretches a wait, by at most its share). No network: the
last test drives the HTTP client against a mock transport with time.sleep recorded."""

from __future__ import annotations

import httpx
import pytest

from clients import retry as retry_module
from clients.http_client import BackoffHTTPClient
from clients.retry import NO_RETRY, Retry
from clients.wire.errors import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    OverloadedError,
    RateLimitError,
    ServerError,
    TransportError,
)

NO_JITTER = Retry(attempts=4, max_wait_s=30.0, jitter=0.0)


@pytest.mark.parametrize(
    "error",
    [
        BadRequestError("bad", 400),
        AuthenticationError("key", 401),
        NotFoundError("gone", 404),
        ServerError("boom", 500),
        TransportError("refused"),
    ],
)
def test_only_overload_is_retried(error):
    """Anything but a refusal may have started the request (or will fail again): to the caller."""
    assert NO_JITTER.delay(error, 0) is None


@pytest.mark.parametrize("error", [OverloadedError("full", 503), RateLimitError("too many", 429)])
def test_overload_and_rate_limit_are_retried(error):
    assert NO_JITTER.delay(error, 0) == 0.5


def test_tries_stop_after_attempts():
    delays = [NO_JITTER.delay(OverloadedError("full"), attempt) for attempt in range(6)]
    assert [d is not None for d in delays] == [True] * 4 + [False] * 2
    assert NO_RETRY.delay(OverloadedError("full"), 0) is None


def test_without_retry_after_the_wait_doubles_from_half_a_second():
    delays = [NO_JITTER.delay(OverloadedError("full"), attempt) for attempt in range(4)]
    assert delays == [0.5, 1.0, 2.0, 4.0]


def test_retry_after_replaces_the_exponential_wait():
    error = OverloadedError("full", retry_after_s=3.0)
    assert [NO_JITTER.delay(error, attempt) for attempt in range(4)] == [3.0] * 4
    assert NO_JITTER.delay(OverloadedError("full", retry_after_s=0.0), 2) == 0.0  # "now" is honoured too


def test_waits_are_capped_by_max_wait():
    capped = Retry(attempts=10, max_wait_s=1.5, jitter=0.0)
    assert capped.delay(OverloadedError("full", retry_after_s=120.0), 0) == 1.5
    assert [capped.delay(OverloadedError("full"), a) for a in range(5)] == [0.5, 1.0, 1.5, 1.5, 1.5]


@pytest.mark.parametrize("draw, stretch", [(0.0, 1.0), (0.5, 1.1), (0.999999, 1.2)])
def test_jitter_stretches_a_wait_by_at_most_its_share(monkeypatch, draw, stretch):
    monkeypatch.setattr(retry_module.random, "random", lambda: draw)
    policy = Retry(attempts=3, max_wait_s=10.0, jitter=0.2)
    assert policy.delay(OverloadedError("full", retry_after_s=10.0), 0) == pytest.approx(10.0 * stretch)
    assert policy.delay(OverloadedError("full"), 1) == pytest.approx(1.0 * stretch)


def test_the_http_client_sleeps_the_policy_s_waits_then_gives_up(monkeypatch):
    """Always refused with Retry-After: 2 -> attempts + 1 sends, a 2 s sleep between each,
    then the last refusal goes to the caller."""
    sent, slept = [], []

    def refuse(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        body = {"error": {"message": "at capacity", "type": "server_error", "param": None, "code": "overloaded"}}
        return httpx.Response(503, json=body, headers={"Retry-After": "2"})

    monkeypatch.setattr("clients.http_client.time.sleep", slept.append)
    http = httpx.Client(transport=httpx.MockTransport(refuse), base_url="http://x")
    with BackoffHTTPClient(http=http, retry=Retry(attempts=3, jitter=0.0)) as client:
        with pytest.raises(OverloadedError) as refused:
            client.complete("hi", max_tokens=1)
    assert refused.value.retry_after_s == 2.0
    assert len(sent) == 4 and slept == [2.0, 2.0, 2.0]


def test_wait_raises_the_error_when_no_try_is_left():
    error = OverloadedError("full", retry_after_s=1.0)
    assert NO_JITTER.wait(error, 0) == 1.0
    with pytest.raises(OverloadedError) as given_up:
        NO_JITTER.wait(error, 4)
    assert given_up.value is error
    with pytest.raises(ServerError):
        NO_JITTER.wait(ServerError("boom", 500), 0)
