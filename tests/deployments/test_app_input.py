"""Bad input and access control against the real Serve application on loopback (tiny models).

One application for the module, deployed by `backoff serve` from the packaged config with
API keys (one in the args, one through an environment variable) and small limits. Every
client mistake must come back as a 4xx with the OpenAI error body, or as gRPC
INVALID_ARGUMENT / NOT_FOUND / UNAUTHENTICATED / RESOURCE_EXHAUSTED, never as a 5xx or
INTERNAL, and no replica may restart. The fuzz test sends a few hundred generated
requests over both transports and checks exactly that.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from clients import AuthenticationError, BadRequestError, RateLimitError, cli  # noqa: E402
from clients.grpc_client import BackoffGrpcClient  # noqa: E402
from clients.http_client import BackoffHTTPClient  # noqa: E402
from clients.wire import backoff_pb2 as pb  # noqa: E402
from clients.wire import backoff_pb2_grpc as pb_grpc  # noqa: E402
from clients.wire.types import Usage  # noqa: E402
from deployments import harness, serve_cli  # noqa: E402
from tests.support.playground_page import PlaygroundPage, browser_missing  # noqa: E402
from tests.support.request_strategies import expected_refusal, grpc_requests, http_bodies  # noqa: E402
from tests.support.served_app import TINY_PAIR, ServedApp, deployment_config, wait_until  # noqa: E402
from tests.support.tiny import tiny_model  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "test-key-a"  # in the config's access.api_keys
ENV_KEY = "test-key-b"  # in the environment variable access.api_keys_env names
KEY_ENV_VAR = "BACKOFF_TEST_API_KEYS"
CONTEXT_WINDOW = 512  # tiny_model's max_position_embeddings
LIMITS = dict(
    max_body_bytes=32_768,
    max_prompt_chars=2_000,
    max_prompt_tokens=300,
    max_tokens=480,
    max_stop=4,
    max_stop_chars=16,
    max_concurrent_per_client=2,
    retry_after_s=3,
)
ERROR_FIELDS = {"message", "type", "param", "code"}
PLAYGROUND_ROUTER = ("random", 0.5)  # the playground test's: half the tokens small, drawn from the seed
CLIENT_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
# M_L big enough (a few ms a token on one thread) that an always-large request of a few
# hundred tokens stays open for seconds: the per-client limit test holds two of them
MODELS = {**TINY_PAIR, "large": functools.partial(tiny_model, 2, hidden=512, layers=8)}


def _edit(config: dict, dirs) -> None:
    args = config["applications"][0]["args"]
    args["default_max_tokens"] = 8
    args["access"].update(api_keys=[KEY], api_keys_env=KEY_ENV_VAR)
    args["limits"].update(LIMITS)
    # no threshold in the config: the router's default, which the threshold gauge shows from the start
    deployment_config(config, "SmallModel")["user_config"]["thresholds"] = None


@pytest.fixture(scope="module")
def served(serve_app) -> ServedApp:
    """With Ray's dashboard (what `serve status` / `serve deploy --address` talk to); the key
    in KEY_ENV_VAR reaches the replicas as the Ray workers inherit the environment."""
    ray_options = {
        "num_cpus": 2,
        "include_dashboard": True,
        "dashboard_port": harness.free_port(),
        "_system_config": serve_cli.RAY_SYSTEM_CONFIG,
    }
    return serve_app("serve-input", MODELS, edit=_edit, ray_options=ray_options, env={KEY_ENV_VAR: f" {ENV_KEY} ,"})


def _auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _grpc_meta(key: str | None = KEY) -> tuple:
    return (("authorization", f"Bearer {key}"),) if key else ()


def _post(served, body, path="/v1/completions", headers=None, **kwargs) -> httpx.Response:
    headers = _auth() if headers is None else headers
    if not isinstance(body, (dict, list)):  # bytes, or an iterator of them (sent chunked)
        return httpx.post(
            f"{served.url}{path}",
            content=body,
            timeout=60,
            headers={"content-type": "application/json", **headers},
            **kwargs,
        )
    return httpx.post(f"{served.url}{path}", json=body, timeout=60, headers=headers, **kwargs)


def _openai_error(response: httpx.Response) -> dict:
    """The error of a 4xx reply, checked to have the OpenAI shape."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and error["message"] and error["type"], error
    return error


def _infos() -> dict[str, tuple]:
    """(pid, replica id) of every deployment's replica: a restart changes them."""

    def call(name, method="info", **options):
        handle = serve.get_deployment_handle(name, "backoff").options(**options)
        return getattr(handle, method).remote().result(timeout_s=30)

    small, ingress = call("SmallModel"), call("Ingress")
    large = call("LargeModel", multiplexed_model_id="probe")
    return {
        "SmallModel": (small.pid, small.replica),
        "Ingress": (ingress.pid, ingress.replica),
        "LargeModel": (large.pid, large.replica),
    }


def _wait_idle(timeout_s: float = 30.0) -> None:
    """No request left open in the SmallModel, no client slot left taken in the Ingress."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        small = serve.get_deployment_handle("SmallModel", "backoff").info.remote().result(timeout_s=30)
        ingress = serve.get_deployment_handle("Ingress", "backoff").info.remote().result(timeout_s=30)
        if small.live == 0 and not ingress.open_by_client:
            return
        time.sleep(0.2)
    pytest.fail(f"still open: router live={small.live}, ingress slots={ingress.open_by_client}")


# -- bad input, one category at a time -------------------------------------------------------

W = "w3 w4 w5"
CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    "body, path, status, param, says",
    [
        # malformed / not JSON / not UTF-8
        (b"{not json", CHAT, 400, None, "not valid JSON"),
        (b'{"prompt": "w3",}', "/v1/completions", 400, None, "not valid JSON"),
        (b"", "/v1/completions", 400, None, ""),
        (b"[1, 2]", "/v1/completions", 400, None, "valid dictionary"),
        (b"null", CHAT, 400, None, ""),
        (b'{"prompt": "w3 \xff\xfe"}', "/v1/completions", 400, None, "UTF-8"),
        # wrong types (strict: no "5" for 5, no 1 for true, no NaN / Infinity)
        ({"prompt": W, "max_tokens": "5"}, "/v1/completions", 400, "max_tokens", "integer"),
        ({"prompt": W, "max_tokens": 5.5}, "/v1/completions", 400, "max_tokens", "integer"),
        ({"prompt": W, "ignore_eos": 1}, "/v1/completions", 400, "ignore_eos", "boolean"),
        ({"prompt": W, "stream": "yes"}, "/v1/completions", 400, "stream", "boolean"),
        ({"prompt": 5}, "/v1/completions", 400, "prompt", ""),
        ({"prompt": [3, "w4"]}, "/v1/completions", 400, "prompt", ""),
        ({"prompt": W, "stop": 3}, "/v1/completions", 400, "stop", ""),
        ({"prompt": W, "seed": 2**64}, "/v1/completions", 400, "seed", ""),
        ({"prompt": W, "router": 7}, "/v1/completions", 400, "router", ""),
        ({"prompt": W, "backoff_threshold": "high"}, "/v1/completions", 400, "backoff_threshold", ""),
        ({"prompt": W, "n": 2}, "/v1/completions", 400, "n", "n=1"),
        ({"prompt": W, "presence_penalty": 0.5}, "/v1/completions", 400, "presence_penalty", ""),
        # temperatures and top_p
        ({"prompt": W, "temperature": -0.5}, "/v1/completions", 400, "temperature", ""),
        (b'{"prompt": "w3", "temperature": NaN}', "/v1/completions", 400, "temperature", "finite"),
        (b'{"prompt": "w3", "temperature": Infinity}', "/v1/completions", 400, "temperature", "finite"),
        ({"prompt": W, "top_p": 0}, "/v1/completions", 400, "top_p", ""),
        ({"prompt": W, "top_p": 1.5}, "/v1/completions", 400, "top_p", ""),
        (b'{"prompt": "w3", "top_p": -Infinity}', "/v1/completions", 400, "top_p", "finite"),
        ({"prompt": W, "top_k": -1}, "/v1/completions", 400, "top_k", ""),
        # empty prompts and messages
        ({"prompt": ""}, "/v1/completions", 400, "prompt", "the prompt is empty"),
        ({"prompt": []}, "/v1/completions", 400, "prompt", "the batch is empty"),
        ({"prompt": "   "}, "/v1/completions", 400, None, "no tokens"),
        ({"max_tokens": 3}, "/v1/completions", 400, "prompt", "required"),
        ({"messages": []}, CHAT, 400, "messages", "at least 1"),
        ({"messages": "hi"}, CHAT, 400, "messages", ""),
        ({"messages": [{"role": "wizard", "content": "w3"}]}, CHAT, 400, "messages.0.role", "'user'"),
        ({"messages": [{"role": "user"}]}, CHAT, 400, "messages.0.content", "required"),
        ({"messages": [{"role": "user", "content": None}]}, CHAT, 400, "messages.0.content", ""),
        ({"messages": [{"role": "user", "content": 5}]}, CHAT, 400, "messages.0.content", ""),
        (b'{"messages": [{"role": "user", "content": "w3 \\ud800"}]}', CHAT, 400, "messages.0.content", "surrogate"),
        (b'{"prompt": "\\udfff w3"}', "/v1/completions", 400, "prompt", "surrogate"),
        # sizes: the configured caps and the context window, each named in the message
        ({"prompt": W, "max_tokens": 0}, "/v1/completions", 400, "max_tokens", ""),
        ({"prompt": W, "max_tokens": 10**9}, "/v1/completions", 400, "max_tokens", "limits.max_tokens"),
        ({"prompt": [3] * 301}, "/v1/completions", 400, "prompt", "limits.max_prompt_tokens"),
        ({"prompt": "w3 " * 700}, "/v1/completions", 400, "prompt", "limits.max_prompt_chars"),
        ({"prompt": "w3 " * 400}, "/v1/completions", 400, None, "limits.max_prompt_tokens"),  # tokenized by the router
        ({"messages": [{"role": "user", "content": "w3 " * 700}]}, CHAT, 400, "messages", "limits.max_prompt_chars"),
        ({"prompt": [3] * 100, "max_tokens": 450}, "/v1/completions", 400, None, f"context window of {CONTEXT_WINDOW}"),
        ({"prompt": [3, 4000]}, "/v1/completions", 400, None, "token ids"),
        ({"prompt": W, "stop": ["a", "b", "c", "d", "e"]}, "/v1/completions", 400, "stop", "limits.max_stop"),
        ({"prompt": W, "stop": ["x" * 17]}, "/v1/completions", 400, "stop", "limits.max_stop_chars"),
        ({"prompt": W, "stop": [""]}, "/v1/completions", 400, "stop.0", ""),
        # routers and thresholds
        ({"prompt": W, "router": "nope"}, "/v1/completions", 400, None, "unknown router"),
        ({"prompt": W, "router": "random", "backoff_threshold": 1.5}, "/v1/completions", 400, None, "[0.0, 1.0]"),
        ({"prompt": W, "router": "max-prob", "backoff_threshold": -0.1}, "/v1/completions", 400, None, "[0.0, 1.0]"),
        ({"prompt": W, "backoff_threshold": [2.0, 1.0]}, "/v1/completions", 400, None, "ascending"),
        ({"prompt": W, "backoff_threshold": [1.0, 2.0]}, "/v1/completions", 400, None, "2 models need 1"),
        ({"prompt": W, "backoff_threshold": []}, "/v1/completions", 400, "backoff_threshold", ""),
        ({"prompt": W, "thresholds": [1.0, 2.0]}, "/v1/completions", 400, None, "2 models need 1"),
        ({"prompt": W, "thresholds": [0.5], "backoff_threshold": [0.5]}, "/v1/completions", 400, None, "not both"),
        ({"prompt": W, "target_backoff": 1.5}, "/v1/completions", 400, "target_backoff", ""),
        # unknown model
        ({"prompt": W, "model": "gpt-9"}, "/v1/completions", 404, "model", "not served"),
    ],
)
def test_bad_http_input_is_a_4xx_with_an_openai_error_body(served, body, path, status, param, says):
    response = _post(served, body, path)
    error = _openai_error(response)
    assert response.status_code == status, response.text
    assert param is None or error["param"] == param, error
    assert says in error["message"], error


def test_unknown_openai_fields_are_ignored_and_streams_refuse_like_unary(served):
    body = {"prompt": W, "max_tokens": 2, "ignore_eos": True, "user": "u1", "logit_bias": {}, "echo": False}
    ok = _post(served, body)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    # a field that would change the answer and is not implemented is refused, never ignored
    assert _openai_error(_post(served, {**body, "logit_bias": {"3": 1}}))["param"] == "logit_bias"
    stream = _post(served, {"prompt": W, "max_tokens": 10**9, "stream": True})
    assert "limits.max_tokens" in _openai_error(stream)["message"]


def test_body_cap_is_a_413_declared_or_streamed(served):
    big = json.dumps({"prompt": "w3 " * 20_000}).encode()
    for content in (big, iter([big[:20_000], big[20_000:]])):  # Content-Length, then chunked
        response = _post(served, content)
        assert response.status_code == 413, response.text
        error = _openai_error(response)
        assert error["code"] == "request_too_large" and "limits.max_body_bytes" in error["message"]


def test_unknown_routes_and_methods_get_openai_bodies(served):
    r = httpx.get(f"{served.url}/v1/completions", headers=_auth(), timeout=30)
    assert r.status_code == 405 and _openai_error(r)
    r = httpx.post(f"{served.url}/v1/nope", headers=_auth(), json={}, timeout=30)
    assert r.status_code == 404 and _openai_error(r)


def test_huge_headers_never_fail_the_service(served):
    # headers are read by uvicorn in Serve's HTTP proxy, before our code: whatever it makes
    # of them (served, or refused in its own words) is not a 5xx, and serving goes on
    for size in (64_000, 1_000_000):
        try:
            r = httpx.post(
                f"{served.url}/v1/completions",
                headers={**_auth(), "x-junk": "j" * size},
                timeout=30,
                json={"prompt": W, "max_tokens": 2},
            )
            assert r.status_code < 500, r.status_code
        except httpx.RemoteProtocolError:  # or it closes the connection
            pass
    bad_key = httpx.get(f"{served.url}/v1/models", headers=_auth("k" * 60_000), timeout=30)
    assert bad_key.status_code == 401 and "kkkk" not in bad_key.text
    assert _post(served, {"prompt": W, "max_tokens": 2}).status_code == 200


def _raw_grpc(served, method: str, data: bytes, key: str | None = KEY, stream: bool = False):
    """Call a method with raw request bytes; returns the status code."""
    with grpc.insecure_channel(served.grpc_target) as channel:
        path = f"/backoff.Backoff/{method}"
        call = (channel.unary_stream if stream else channel.unary_unary)(path)
        try:
            reply = call(data, metadata=_grpc_meta(key), timeout=60)
            if stream:
                list(reply)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            return exc.code(), exc.details()


@pytest.mark.parametrize(
    "request_, code, says",
    [
        (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "exactly one"),
        (pb.GenerateRequest(prompt="w3", prompt_ids=[3]), grpc.StatusCode.INVALID_ARGUMENT, "exactly one"),
        (pb.GenerateRequest(prompt="w3", temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "finite"),
        (pb.GenerateRequest(prompt="w3", temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (pb.GenerateRequest(prompt="w3", top_p=math.inf), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (pb.GenerateRequest(prompt="w3", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (pb.GenerateRequest(prompt="w3", max_tokens=2**32 - 1), grpc.StatusCode.INVALID_ARGUMENT, "limits.max_tokens"),
        (pb.GenerateRequest(prompt="w3 " * 700), grpc.StatusCode.INVALID_ARGUMENT, "limits.max_prompt_chars"),
        (pb.GenerateRequest(prompt_ids=[3] * 100, max_tokens=450), grpc.StatusCode.INVALID_ARGUMENT, "context window"),
        (pb.GenerateRequest(prompt="w3", stop=["a"] * 5), grpc.StatusCode.INVALID_ARGUMENT, "limits.max_stop"),
        (pb.GenerateRequest(prompt="w3", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
        (pb.GenerateRequest(prompt="w3", router="nope"), grpc.StatusCode.INVALID_ARGUMENT, "unknown router"),
        (
            pb.GenerateRequest(prompt="w3", router="random", backoff_threshold=[2.0]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "[0.0, 1.0]",
        ),
        (pb.GenerateRequest(prompt="w3", backoff_threshold=[math.inf]), grpc.StatusCode.INVALID_ARGUMENT, "finite"),
        (
            pb.GenerateRequest(prompt="w3", backoff_threshold=[1, 2]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "2 models need 1",
        ),
        (pb.GenerateRequest(prompt="w3", thresholds=[1, 2]), grpc.StatusCode.INVALID_ARGUMENT, "2 models need 1"),
        (
            pb.GenerateRequest(prompt="w3", thresholds=[0.5], backoff_threshold=[0.5]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not both",
        ),
        (
            pb.GenerateRequest(messages=[pb.ChatMessage(role="bot", content="w3")]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "role",
        ),
        (pb.GenerateRequest(prompt="w3", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "not served"),
    ],
)
def test_bad_grpc_input_is_invalid_argument_or_not_found(served, request_, code, says):
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.BackoffStub(channel)
        for call in (
            lambda: stub.Generate(request_, metadata=_grpc_meta(), timeout=60),
            lambda: list(stub.GenerateStream(request_, metadata=_grpc_meta(), timeout=60)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == code and says in err.value.details(), err.value.details()


def test_grpc_bytes_that_do_not_parse_are_invalid_argument(served):
    bad_utf8 = b"\x0a\x03w3\xff"  # field 1 (prompt), 3 bytes, not UTF-8
    for data in (bad_utf8, b"\xff\xff\xff\xff", b"\x0a\x7f"):
        for stream in (False, True):
            code, details = _raw_grpc(served, "GenerateStream" if stream else "Generate", data, stream=stream)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid backoff.GenerateRequest" in details
    ok = pb.GenerateRequest(prompt="w3 w4", max_tokens=2).SerializeToString()
    assert _raw_grpc(served, "Generate", ok)[0] == grpc.StatusCode.OK


# -- access: API keys ---------------------------------------------------------------------------


def test_http_needs_an_api_key_except_for_health(served):
    body = {"prompt": W, "max_tokens": 2}
    for headers in ({}, _auth("wrong"), {"Authorization": KEY}, {"Authorization": "Basic abc"}):
        r = _post(served, body, headers=headers)
        assert r.status_code == 401 and _openai_error(r)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer" and "wrong" not in r.text
    r = _post(served, b"{not json", headers={})  # the key is checked before the body is read
    assert r.status_code == 401
    assert httpx.get(f"{served.url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{served.url}/health", timeout=30).status_code == 200  # open: load balancers probe it
    for key in (KEY, ENV_KEY):  # from the config's args and from the environment variable
        assert _post(served, body, headers=_auth(key)).status_code == 200


def test_openai_package_gets_authentication_error_and_works_with_the_key(served):
    openai = pytest.importorskip("openai")
    wrong = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="backoff", prompt=W, max_tokens=2)
    right = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0)
    done = right.completions.create(model="backoff", prompt=W, max_tokens=2, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError):
        right.completions.create(model="backoff", prompt=W, max_tokens=10**6)


def test_grpc_needs_an_api_key_except_for_health(served):
    request = pb.GenerateRequest(prompt=W, max_tokens=2, ignore_eos=True)
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.BackoffStub(channel)
        for meta in ((), _grpc_meta("wrong"), (("authorization", KEY),)):
            for call in (
                lambda meta=meta: stub.Generate(request, metadata=meta, timeout=60),
                lambda meta=meta: list(stub.GenerateStream(request, metadata=meta, timeout=60)),
                lambda meta=meta: stub.Models(pb.ModelsRequest(), metadata=meta, timeout=60),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Health(pb.HealthRequest(), timeout=60).ok
        assert stub.Generate(request, metadata=_grpc_meta(ENV_KEY), timeout=60).usage.completion_tokens == 2


def test_clients_send_the_key_from_the_argument_or_the_environment(served, monkeypatch, capsys):
    monkeypatch.delenv("BACKOFF_API_KEY", raising=False)
    with BackoffHTTPClient(served.url) as http, BackoffGrpcClient(served.grpc_target) as rpc:
        for client in (http, rpc):
            with pytest.raises(AuthenticationError):
                client.complete(W, max_tokens=2, ignore_eos=True)
    with BackoffHTTPClient(served.url, api_key=KEY) as http, BackoffGrpcClient(served.grpc_target, api_key=KEY) as rpc:
        assert http.complete(W, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        assert rpc.complete(W, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        assert http.models() == rpc.models() == ["backoff"]
        for client in (http, rpc):  # a refused request is the same exception on both transports
            with pytest.raises(BadRequestError):
                client.complete(W, max_tokens=10**6)
    monkeypatch.setenv("BACKOFF_API_KEY", ENV_KEY)
    with BackoffHTTPClient(served.url) as http, BackoffGrpcClient(served.grpc_target) as rpc:
        assert http.complete(W, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        assert rpc.complete(W, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    assert cli.main(["--url", served.url, "generate", W, "--max-tokens", "2", "--ignore-eos", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["usage"]["completion_tokens"] == 2
    monkeypatch.delenv("BACKOFF_API_KEY")
    assert cli.main(["--grpc", served.grpc_target, "--api-key", KEY, "models"]) == 0
    assert cli.main(["--grpc", served.grpc_target, "models"]) == 2  # refused: a client error
    assert "AuthenticationError" in capsys.readouterr().err


# -- access: concurrent requests per client -------------------------------------------------------


def test_concurrent_requests_per_client_are_capped(served):
    long = {
        "prompt": [3, 4, 5],
        "max_tokens": 470,
        "ignore_eos": True,
        "router": "always-large",
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(base_url=served.url, timeout=60, headers=_auth()) as http, ExitStack() as open_streams:
        responses = [open_streams.enter_context(http.stream("POST", "/v1/completions", json=long)) for _ in range(2)]
        readers = [r.iter_lines() for r in responses]  # kept: dropping one would close its connection
        for response, reader in zip(responses, readers):  # both admitted and generating
            assert response.status_code == 200
            assert next(line for line in reader if line.startswith("data:")).startswith('data: {"id"')
        slots = serve.get_deployment_handle("Ingress", "backoff").info.remote().result(timeout_s=30)
        assert list(slots.open_by_client.values()) == [2]  # one client (by key digest), two requests
        third = http.post("/v1/completions", json={"prompt": W, "max_tokens": 2})
        assert third.status_code == 429 and third.headers["retry-after"] == str(LIMITS["retry_after_s"])
        error = _openai_error(third)
        assert error["type"] == "rate_limit_error" and "per ingress replica" in error["message"]
        with BackoffHTTPClient(served.url, api_key=KEY) as client, pytest.raises(RateLimitError) as limited:
            client.complete(W, max_tokens=2, ignore_eos=True)
        assert limited.value.retry_after_s == LIMITS["retry_after_s"]
        with grpc.insecure_channel(served.grpc_target) as channel:  # the same client over gRPC
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.BackoffStub(channel).Generate(
                    pb.GenerateRequest(prompt=W, max_tokens=2), metadata=_grpc_meta(), timeout=60
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(err.value.trailing_metadata())["retry-after"] == str(LIMITS["retry_after_s"])
        other = _post(served, {"prompt": W, "max_tokens": 2}, headers=_auth(ENV_KEY))  # another client
        assert other.status_code == 200
    _wait_idle()  # disconnects free the slots
    assert _post(served, {"prompt": W, "max_tokens": 2}).status_code == 200


# -- fuzz: hundreds of generated requests, no 5xx, no restart ----------------------------------------

FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "router",
    "backoff_threshold",
    "target_backoff",
    "model",
    "stream",
    "n",
    "presence_penalty",
    "stream_options",
    "user",
    "logit_bias",
]
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(0, 6)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["entropy", "random", "always-large", "nope", "user", "assistant", "w3 w4", "", "w3 \ud800"])
)  # a lone surrogate: JSON can spell it, UTF-8 cannot
JSON_VALUES = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@st.composite
def http_cases(draw) -> tuple[str, bytes, dict]:
    """(path, body bytes, headers): a valid request with a few fields broken, or junk."""
    chat = draw(st.booleans())
    text = draw(st.sampled_from(["w3 w4", "w3 w4", "w3 w4", "w3 \udfff", "\u00e9 \U0001f600"]))
    body: dict = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    body["max_tokens"] = draw(st.integers(1, 4))
    for _ in range(draw(st.integers(0, 3))):
        body[draw(st.sampled_from(FIELDS) | st.text(max_size=6))] = draw(JSON_VALUES)
    text = json.dumps(body)  # NaN / Infinity stay as Python's JSON spells them
    kind = draw(st.sampled_from(["json", "json", "json", "cut", "bytes", "latin-1"]))
    if kind == "cut":
        data = text.encode()[: draw(st.integers(0, len(text)))]
    elif kind == "bytes":
        data = draw(st.binary(max_size=64))
    elif kind == "latin-1":
        data = text.encode() + b"\xe9\xff"
    else:
        data = text.encode()
    key = draw(st.sampled_from([KEY, KEY, KEY, KEY, ENV_KEY, None, "wrong"]))
    headers = {"content-type": draw(st.sampled_from(["application/json", "application/json", "text/plain"]))}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return ("/v1/chat/completions" if chat else "/v1/completions"), data, headers


_opt_float = st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.floats(0, 2)
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=16)


@st.composite
def grpc_cases(draw) -> tuple[str, bytes, str | None]:
    """(method, request bytes, key): a GenerateRequest with arbitrary typed fields, or junk bytes."""
    method = draw(st.sampled_from(["Generate", "GenerateStream"]))
    key = draw(st.sampled_from([KEY, KEY, ENV_KEY]))
    if draw(st.integers(0, 5)) == 0:
        return method, draw(st.binary(max_size=64)), key
    msg = pb.GenerateRequest()
    form = draw(st.sampled_from(["prompt", "ids", "messages", "none", "two"]))
    if form in ("prompt", "two"):
        msg.prompt = draw(st.sampled_from(["w3 w4", " ", "w3 " * 800]) | _text)
    if form in ("ids", "two"):
        msg.prompt_ids.extend(draw(st.lists(st.integers(0, 60) | st.integers(0, 2**32 - 1), max_size=8)))
    if form == "messages":
        for _ in range(draw(st.integers(0, 3))):
            msg.messages.add(
                role=draw(st.sampled_from(["user", "system", "assistant", "", "bot"])), content=draw(_text)
            )
    for name, values in (
        ("max_tokens", st.none() | st.integers(0, 6) | st.integers(0, 2**32 - 1)),
        ("temperature", _opt_float),
        ("top_p", _opt_float),
        ("target_backoff", _opt_float),
        ("top_k", st.none() | st.integers(0, 2**32 - 1)),
        ("seed", st.none() | st.integers(-(2**63), 2**63 - 1)),
        ("router", st.none() | st.sampled_from(["entropy", "random", "max-prob", "x"]) | _text),
    ):
        value = draw(values)
        if value is not None:
            setattr(msg, name, value)
    if not msg.HasField("max_tokens") and draw(st.booleans()):
        msg.max_tokens = 4
    msg.stop.extend(draw(st.lists(_text, max_size=6)))
    msg.backoff_threshold.extend(draw(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=3)))
    msg.model = draw(st.sampled_from(["", "", "backoff", "gpt-9"]))
    msg.ignore_eos = draw(st.booleans())
    return method, msg.SerializeToString(), key


def _check_http_reply(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code != 200:
        _openai_error(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), response.text
    else:
        assert response.json()["choices"], response.text


def test_fuzz_hundreds_of_bad_requests_never_fail_the_service(served):
    before = _infos()
    statuses: Counter = Counter()
    codes: Counter = Counter()

    def relaxed(n: int) -> settings:  # reproducible (derandomized), as many examples as asked
        return settings(
            max_examples=n,
            deadline=None,
            database=None,
            derandomize=True,
            print_blob=True,
            suppress_health_check=list(HealthCheck),
        )

    with httpx.Client(base_url=served.url, timeout=60) as http:

        @relaxed(400)
        @given(http_cases())
        def over_http(case):
            path, data, headers = case
            response = http.post(path, content=data, headers=headers)
            _check_http_reply(response)
            statuses[response.status_code] += 1

        over_http()

    with grpc.insecure_channel(served.grpc_target) as channel:

        @relaxed(250)
        @given(grpc_cases())
        def over_grpc(case):
            method, data, key = case
            stream = method == "GenerateStream"
            call = (channel.unary_stream if stream else channel.unary_unary)(f"/backoff.Backoff/{method}")
            try:
                reply = call(data, metadata=_grpc_meta(key), timeout=60)
                if stream:
                    list(reply)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                assert code in CLIENT_CODES, (code, exc.details())
            codes[code.name] += 1

        over_grpc()

    sent = sum(statuses.values()) + sum(codes.values())
    print(f"fuzz: {sent} requests; HTTP {dict(statuses)}; gRPC {dict(codes)}")
    assert sent >= 300 and statuses[200] > 0 and statuses[400] > 0 and statuses[401] > 0
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0
    _wait_idle()
    assert _infos() == before  # no replica restarted
    ok = _post(served, {"prompt": W, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


# -- properties: any body the schema accepts is served JSON-safe, any other is a 400 naming its field ---------


def _strict_json(text: str):
    """JSON as a strict parser reads it: NaN / Infinity (which Python writes) are not JSON."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _relaxed(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )


def test_property_http_bodies_are_served_json_safe_or_refused_naming_the_field(served):
    with httpx.Client(base_url=served.url, timeout=60, headers=_auth()) as http:

        @_relaxed(90)
        @given(http_bodies())
        def check(case):
            path, body = case
            refused = expected_refusal(path, body, LIMITS["max_tokens"])
            response = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            assert response.status_code < 500, (response.status_code, response.text)
            if refused is not None:
                error = _openai_error(response)
                assert response.status_code == 400 and (error["param"] or "") == refused, (refused, error)
                return
            assert response.status_code == 200, (response.status_code, response.text, body)
            if response.headers["content-type"].startswith("text/event-stream"):
                events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]", response.text
                chunks = [_strict_json(e) for e in events[:-1]]
                assert chunks and not any("error" in c for c in chunks), response.text
                assert chunks[-1]["usage"]["completion_tokens"] >= 1
            else:
                reply = _strict_json(response.text)
                choice = reply["choices"][0]
                assert isinstance(choice["text"] if "text" in choice else choice["message"]["content"], str)
                assert reply["usage"]["completion_tokens"] >= 1
                assert all(math.isfinite(t) for t in choice["backoff"]["thresholds"])
                asked = body.get("logprobs") is True if "message" in choice else body.get("logprobs") is not None
                assert (choice["logprobs"] is not None) == asked, (body, choice["logprobs"])

        check()


def test_property_grpc_requests_are_ok_or_invalid_argument(served):
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.BackoffStub(channel)

        @_relaxed(60)
        @given(grpc_requests(), st.booleans())
        def check(request, stream):
            try:
                if stream:
                    chunks = list(stub.GenerateStream(request, metadata=_grpc_meta(), timeout=60))
                    assert chunks[-1].finish_reason and chunks[-1].usage.completion_tokens >= 1
                else:
                    reply = stub.Generate(request, metadata=_grpc_meta(), timeout=60)
                    assert reply.usage.completion_tokens >= 1 and all(math.isfinite(t) for t in reply.thresholds)
                    assert len(reply.logprobs) == (reply.usage.completion_tokens if request.HasField("logprobs") else 0)
                served_ok = True
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details(), request)
                served_ok = False
            in_range = (
                (not request.HasField("temperature") or 0 <= request.temperature <= 2)
                and (not request.HasField("top_p") or 0 < request.top_p <= 1)
                and (not request.HasField("target_backoff") or 0 <= request.target_backoff <= 1)
                and all(abs(t) <= 1e38 for t in request.backoff_threshold)
                and (not request.HasField("logprobs") or request.logprobs <= 20)
                and 1 <= request.max_tokens <= LIMITS["max_tokens"]
            )
            assert served_ok == in_range, (request, served_ok)

        check()


# -- logs: a refused gRPC stream is one WARNING line, no traceback -----------------------------------


def test_a_refused_grpc_stream_logs_one_warning_line(served):
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())  # this session's (no public API)

    def sizes() -> dict[Path, int]:
        return {p: p.stat().st_size for p in logs.rglob("*.log") if p.is_file()}

    before = sizes()
    marker = f"refused-{uuid.uuid4().hex[:12]}"
    for request, code in (
        (pb.GenerateRequest(prompt=W, model=marker), grpc.StatusCode.NOT_FOUND),
        (pb.GenerateRequest(prompt=W, router=marker), grpc.StatusCode.INVALID_ARGUMENT),
    ):
        assert _raw_grpc(served, "GenerateStream", request.SerializeToString(), stream=True)[0] == code

    def new_text() -> dict[Path, str]:
        out = {}
        for path in sizes():
            with open(path, "rb") as f:
                f.seek(before.get(path, 0))
                out[path] = f.read().decode("utf-8", "replace")
        return out

    deadline = time.monotonic() + 30
    while sum(t.count(marker) for t in new_text().values()) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(1.0)  # a second record (the replica's) would come within this
    text = new_text()
    lines = [line for t in text.values() for line in t.splitlines() if marker in line]
    assert len(lines) == 2 and all(line.startswith("WARNING") for line in lines), lines  # one per request
    assert not any("Traceback" in t for t in text.values()), {
        str(p): t[-2000:] for p, t in text.items() if "Traceback" in t
    }


# -- Ray's own CLI: `serve status` and `serve deploy` (a live threshold change), the threshold gauge -----


def _gauge(metrics_url: str) -> dict[str, float]:
    """ray_backoff_threshold of the `backoff` app: boundary -> value."""
    found = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("ray_backoff_threshold{") and 'application="backoff"' in line:
            labels, value = line.rsplit(" ", 1)
            found[re.search(r'boundary="(\d+)"', labels).group(1)] = float(value)
    return found


def _eventually(predicate, what: str) -> None:
    wait_until(predicate, what, 60.0, every_s=0.5)


def test_serve_cli_status_and_deploy_change_the_live_threshold(served, tmp_path):
    hints = serve_cli.local_ray_hints()  # what `backoff serve` prints about this Ray (metrics URL, auth for Ray's CLI)
    metrics_url = re.search(r"http://\S+/metrics", hints).group(0)
    # published from the start: the config names no threshold, so the entropy router's default
    _eventually(lambda: _gauge(metrics_url) == {"0": 2.0}, f"no threshold gauge at start: {_gauge(metrics_url)}")
    # Ray's CLI in a fresh shell, given exactly what `backoff serve` says to export
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env.update(re.findall(r"export (\w+)=(\S+)", hints))
    cli_ = str(Path(sys.executable).with_name("serve"))
    edited = yaml.safe_load(served.config_path.read_text())
    deployment_config(edited, "SmallModel")["user_config"]["thresholds"] = [0.25]
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(edited))
    deploy = subprocess.run(
        [cli_, "deploy", str(path), "--address", served.dashboard], env=env, capture_output=True, text=True, timeout=120
    )
    assert deploy.returncode == 0, deploy.stderr[-2000:]
    status = subprocess.run(
        [cli_, "status", "--address", served.dashboard], env=env, capture_output=True, text=True, timeout=120
    )
    assert status.returncode == 0 and "backoff" in status.stdout, status.stderr[-2000:]
    _eventually(
        lambda: (
            serve.get_deployment_handle("SmallModel", "backoff").info.remote().result(timeout_s=30).policy.thresholds
            == [0.25]
        ),
        "the deploy did not reach the SmallModel",
    )
    reply = _post(served, {"prompt": W, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["choices"][0]["backoff"]["thresholds"] == [0.25], reply.text
    _eventually(lambda: _gauge(metrics_url) == {"0": 0.25}, f"the gauge did not follow: {_gauge(metrics_url)}")


# -- the playground page in a real browser (it sets its router and threshold: the live change above is no matter)


def test_playground_asks_for_the_key_and_colours_each_token_by_its_source(served, tmp_path):
    """Headless Chromium on /playground: the page loads without a key, shows the server's 401
    message, takes the key; a prompt at a threshold that mixes sources streams into
    spans of both sources, equal to the same request made by our client, and the counters
    show the final chunk's usage; compare mode runs always-large beside it; a refused
    request shows the server's message."""
    missing = browser_missing()
    if missing:
        pytest.skip(missing)
    page_html = httpx.get(f"{served.url}/playground", timeout=30)  # no key: the page itself is open
    assert page_html.status_code == 200 and "playground/playground.js" in page_html.text
    assert httpx.get(f"{served.url}/playground/playground.js", timeout=30).status_code == 200
    assert httpx.get(f"{served.url}/v1/routing", timeout=30).status_code == 401  # the data is not
    prompt, fields = "w3 w5 w7 w11", dict(max_tokens=24, temperature=0, seed=5, ignore_eos=True)
    router, threshold = PLAYGROUND_ROUTER
    with BackoffHTTPClient(served.url, api_key=KEY) as client:
        reference = client.chat(
            [{"role": "user", "content": prompt}], router=router, backoff_threshold=threshold, **fields
        )
    assert {0, 1} <= set(reference.sources)  # the threshold mixes sources
    with PlaygroundPage(served.url) as page:
        _playground_takes_the_key(page)
        page.set(prompt=prompt, mode="chat", temperature=0, max_tokens=24, seed=5, ignore_eos=True)
        page.set_panel("a", router, [threshold])
        a = _playground_run_equals(page, reference)
        _playground_compares_with_always_large(page, a, Path(os.environ.get("BACKOFF_RESULTS", tmp_path)))
        _playground_shows_a_refusal(page)
        _playground_drops_retracted_spans(page)


def _playground_takes_the_key(page: PlaygroundPage) -> None:
    """No key: the server's message; a wrong key: refused; the right one: the page is ready."""
    page.wait("return !document.getElementById('key-dialog').hidden")
    assert "no API key" in page.key_dialog()[1]
    page.enter_key("wrong")
    page.wait("return document.getElementById('key-error').textContent.includes('not valid')")
    page.enter_key(KEY)
    page.ready()
    assert page.key_dialog()[0] is False


def _playground_run_equals(page: PlaygroundPage, reference):
    """Panel a's run: the client's text and sources, the final chunk's usage in its counters."""
    page.run()
    a = page.panel("a")
    assert a.status == "done (length)" and not a.error, a
    assert a.text == reference.text and a.sources == reference.sources, (a, reference)
    usage = Usage(**a.usage)
    assert usage == reference.usage and len(a.sources) == usage.completion_tokens
    assert (a.sources.count(0), a.sources.count(1)) == (usage.small_tokens, usage.large_tokens)
    assert a.counters["rate"] == f"{100 * usage.backoff_rate:.1f} %"
    assert a.counters["large-calls"] == str(usage.large_calls) and usage.large_calls > 0
    assert a.counters["tokens"].startswith(f"{usage.completion_tokens} (")
    assert a.counters["ttft"].endswith(" ms") and float(a.counters["tps"]) > 0
    return a


def _playground_compares_with_always_large(page: PlaygroundPage, a, results: Path) -> None:
    page.set(compare=True)  # panel b: always-large beside panel a's threshold
    page.run()
    a2, b = page.panel("a"), page.panel("b")
    assert a2.sources == a.sources and a2.text == a.text
    assert b.status == "done (length)" and set(b.sources) == {1} and len(b.sources) == 24, b
    assert b.counters["rate"] == "0.0 %" and b.counters["large-calls"] == str(b.usage["large_calls"])
    page.screenshot(results / "playground.png")


def _playground_shows_a_refusal(page: PlaygroundPage) -> None:
    page.set(compare=False, max_tokens=LIMITS["max_tokens"] + 1)  # over limits.max_tokens: a 400
    page.run()
    refused = page.panel("a")
    assert refused.status == "error" and "limits.max_tokens" in refused.error, refused


def _playground_drops_retracted_spans(page: PlaygroundPage) -> None:
    """A verification rollback (not reachable from a request's fields): the page's own fetch
    answers with chunks in the server's shape; `retracted` drops the last spans."""
    page.js(
        """const chunks = arguments[0].map(c => 'data: ' + JSON.stringify(c) + '\\n\\n').join('')
                   + 'data: [DONE]\\n\\n';
               window.fetch = async () => new Response(chunks, {status: 200,
                                                                headers: {'content-type': 'text/event-stream'}});""",
        _rollback_chunks(),
    )
    page.set(max_tokens=3)
    page.run()
    rolled = page.panel("a")
    assert (rolled.text, rolled.sources, rolled.status) == ("aBd", [0, 1, 0], "done (length)"), rolled
    assert rolled.counters["rate"] == "66.7 %" and rolled.counters["large-calls"] == "1"


def _rollback_chunks() -> list[dict]:
    """a b c from small; the large model's B retracts b and c; d from small."""

    def token(index, source, text, retracted=0):
        return {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "backoff",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": text},
                    "finish_reason": None,
                    "backoff": {
                        "token_id": index,
                        "source": source,
                        "index": index,
                        "retracted": retracted,
                        "retracted_text": "",
                    },
                }
            ],
        }

    usage = Usage(prompt_tokens=1, completion_tokens=3, total_tokens=4, small_tokens=2, large_tokens=1, large_calls=1)
    final = {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "backoff",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
        "usage": usage.model_dump(),
    }
    return [
        token(0, 0, "a"),
        token(1, 0, "b"),
        token(2, 0, "c"),
        token(1, 1, "B", retracted=2),
        token(2, 0, "d"),
        final,
    ]
