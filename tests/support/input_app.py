"""The application of the bad-input and access modules (tests/deployments/test_app_input.py,
test_app_input_fuzz.py, test_app_input_access.py; test_app_input_sizes.py adds a second
application beside it), and the calls they make to it.

Deployed by `backoff serve` from the packaged config with API keys (one in the args, one
through an environment variable) and small limits, with Ray's dashboard (what `serve status`
and `serve deploy --address` talk to). Every client mistake must come back as a 4xx with the
OpenAI error body, or as gRPC INVALID_ARGUMENT / NOT_FOUND / UNAUTHENTICATED /
RESOURCE_EXHAUSTED, never as a 5xx or INTERNAL, and no replica may restart.

Ray is imported lazily, as in served_app.py: collecting the modules must not need it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, settings

from deployments import harness, serve_cli
from tests.support.served_app import TINY_PAIR, ServedApp, deployment_config
from tests.support.tiny import tiny_model

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
CLIENT_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
# M_L big enough (a few ms a token on one thread) that an always-large request of a few
# hundred tokens stays open for seconds: the per-client limit test holds two of them
MODELS = {**TINY_PAIR, "large": functools.partial(tiny_model, 2, hidden=512, layers=8)}
W = "w3 w4 w5"  # a prompt of three tiny-vocabulary words
SHARED_KEY = "input"  # the modules' SHARED_APP: one deploy serves the four of them, one after another


def _edit(config: dict, dirs) -> None:
    args = config["applications"][0]["args"]
    args["default_max_tokens"] = 8
    args["access"].update(api_keys=[KEY], api_keys_env=KEY_ENV_VAR)
    args["limits"].update(LIMITS)
    # no threshold in the config: the router's default, which the threshold gauge shows from the start
    deployment_config(config, "SmallModel")["user_config"]["thresholds"] = None


def start(serve_app: Callable[..., ServedApp], name: str = "serve-input") -> ServedApp:
    """The application, through `serve_app` (the modules share it: SHARED_KEY, and
    tests/deployments/conftest.py's `shared_app`); the key in KEY_ENV_VAR reaches the
    replicas as the Ray workers inherit the environment."""
    ray_options = {
        "num_cpus": 2,
        "include_dashboard": True,
        "dashboard_port": harness.free_port(),
        "_system_config": serve_cli.RAY_SYSTEM_CONFIG,
    }
    return serve_app(name, MODELS, edit=_edit, ray_options=ray_options, env={KEY_ENV_VAR: f" {ENV_KEY} ,"})


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def grpc_meta(key: str | None = KEY) -> tuple:
    return (("authorization", f"Bearer {key}"),) if key else ()


def post(served: ServedApp, body, path="/v1/completions", headers=None, **kwargs) -> httpx.Response:
    headers = auth() if headers is None else headers
    if not isinstance(body, (dict, list)):  # bytes, or an iterator of them (sent chunked)
        return httpx.post(
            f"{served.url}{path}",
            content=body,
            timeout=60,
            headers={"content-type": "application/json", **headers},
            **kwargs,
        )
    return httpx.post(f"{served.url}{path}", json=body, timeout=60, headers=headers, **kwargs)


def openai_error(response: httpx.Response) -> dict:
    """The error of a 4xx reply, checked to have the OpenAI shape."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and error["message"] and error["type"], error
    return error


def raw_grpc(served: ServedApp, method: str, data: bytes, key: str | None = KEY, stream: bool = False):
    """Call a method with raw request bytes; returns (status code, details)."""
    with grpc.insecure_channel(served.grpc_target) as channel:
        path = f"/backoff.Backoff/{method}"
        call = (channel.unary_stream if stream else channel.unary_unary)(path)
        try:
            reply = call(data, metadata=grpc_meta(key), timeout=60)
            if stream:
                list(reply)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            return exc.code(), exc.details()


def infos() -> dict[str, tuple]:
    """(pid, replica id) of every deployment's replica: a restart changes them."""
    from ray import serve

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


def wait_idle(timeout_s: float = 30.0) -> None:
    """No request left open in the SmallModel, no client slot left taken in the Ingress."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        small = serve.get_deployment_handle("SmallModel", "backoff").info.remote().result(timeout_s=30)
        ingress = serve.get_deployment_handle("Ingress", "backoff").info.remote().result(timeout_s=30)
        if small.live == 0 and not ingress.open_by_client:
            return
        time.sleep(0.2)
    pytest.fail(f"still open: router live={small.live}, ingress slots={ingress.open_by_client}")


def relaxed(n: int) -> settings:
    """hypothesis settings: reproducible (derandomized), as many examples as asked, no deadline."""
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
