"""Bad input against the real Serve application on loopback (tiny models; the app and its
calls: tests/support/input_app.py). Every client mistake must come back as a 4xx with the
OpenAI error body, or as gRPC INVALID_ARGUMENT / NOT_FOUND, never as a 5xx or INTERNAL; a
refused stream logs one WARNING line. The fuzz and property tests (test_app_input_fuzz.py) send
generated requests; access control is test_app_input_access.py.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest

ray = pytest.importorskip("ray")

from clients.wire import backoff_pb2 as pb  # noqa: E402
from clients.wire import backoff_pb2_grpc as pb_grpc  # noqa: E402
from tests.support import input_app  # noqa: E402
from tests.support.input_app import CONTEXT_WINDOW, W, auth, grpc_meta, openai_error, post, raw_grpc  # noqa: E402
from tests.support.served_app import ServedApp  # noqa: E402

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)
SHARED_APP = input_app.SHARED_KEY  # the app of test_app_input*.py, deployed once for the three


@pytest.fixture(scope="module")
def served(shared_app) -> ServedApp:
    return shared_app(SHARED_APP, input_app.start)


# -- bad input, one category at a time -------------------------------------------------------

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
        ({"prompt": W, "n": 0}, "/v1/completions", 400, "n", "greater than or equal to 1"),
        ({"prompt": W, "n": 33}, "/v1/completions", 400, "n", "limits.max_batch_prompts"),
        ({"prompt": [W, W], "n": 17}, "/v1/completions", 400, "n", "34 choices"),
        ({"prompt": W, "presence_penalty": 2.5}, "/v1/completions", 400, "presence_penalty", ""),
        ({"prompt": W, "repetition_penalty": 0}, "/v1/completions", 400, "repetition_penalty", ""),
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
        ({"messages": [{"role": "", "content": "w3"}]}, CHAT, 400, "messages.0.role", "at least 1"),
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
    response = post(served, body, path)
    error = openai_error(response)
    assert response.status_code == status, response.text
    assert param is None or error["param"] == param, error
    assert says in error["message"], error


def test_unknown_openai_fields_are_ignored_and_streams_refuse_like_unary(served):
    body = {"prompt": W, "max_tokens": 2, "ignore_eos": True, "user": "u1", "logit_bias": {}, "echo": False}
    ok = post(served, body)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    # a field that would change the answer and is not implemented is refused, never ignored
    assert openai_error(post(served, {**body, "guided_choice": ["a"]}))["param"] == "guided_choice"
    stream = post(served, {"prompt": W, "max_tokens": 10**9, "stream": True})
    assert "limits.max_tokens" in openai_error(stream)["message"]


def test_body_cap_is_a_413_declared_or_streamed(served):
    big = json.dumps({"prompt": "w3 " * 20_000}).encode()
    for content in (big, iter([big[:20_000], big[20_000:]])):  # Content-Length, then chunked
        response = post(served, content)
        assert response.status_code == 413, response.text
        error = openai_error(response)
        assert error["code"] == "request_too_large" and "limits.max_body_bytes" in error["message"]


def test_unknown_routes_and_methods_get_openai_bodies(served):
    r = httpx.get(f"{served.url}/v1/completions", headers=auth(), timeout=30)
    assert r.status_code == 405 and openai_error(r)
    r = httpx.post(f"{served.url}/v1/nope", headers=auth(), json={}, timeout=30)
    assert r.status_code == 404 and openai_error(r)


def test_serves_proxy_timeout_is_an_openai_error_not_its_text(served):
    # Serve's proxy answers a request past its timeout (http_options.request_timeout_s, or a
    # client's x-request-timeout-seconds header) itself, in plain text; our middleware in the
    # proxy (deployments/proxy_errors.py) makes it JSON
    r = post(
        served,
        {"prompt": W, "max_tokens": 400, "ignore_eos": True},
        headers={**auth(), "x-request-timeout-seconds": "0.05"},
    )
    assert r.status_code == 408, r.text
    error = openai_error(r)
    assert error["code"] == "request_timeout" and "timed out" not in error["message"]


def test_huge_headers_never_fail_the_service(served):
    # headers are read by uvicorn in Serve's HTTP proxy, before our code: whatever it makes
    # of them (served, or refused in its own words) is not a 5xx, and serving goes on
    for size in (64_000, 1_000_000):
        try:
            r = httpx.post(
                f"{served.url}/v1/completions",
                headers={**auth(), "x-junk": "j" * size},
                timeout=30,
                json={"prompt": W, "max_tokens": 2},
            )
            assert r.status_code < 500, r.status_code
        except httpx.RemoteProtocolError:  # or it closes the connection
            pass
    bad_key = httpx.get(f"{served.url}/v1/models", headers=auth("k" * 60_000), timeout=30)
    assert bad_key.status_code == 401 and "kkkk" not in bad_key.text
    assert post(served, {"prompt": W, "max_tokens": 2}).status_code == 200


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
            pb.GenerateRequest(messages=[pb.ChatMessage(role="", content="w3")]),  # any other role: the template's
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
            lambda: stub.Generate(request_, metadata=grpc_meta(), timeout=60),
            lambda: list(stub.GenerateStream(request_, metadata=grpc_meta(), timeout=60)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == code and says in err.value.details(), err.value.details()


def test_grpc_bytes_that_do_not_parse_are_invalid_argument(served):
    bad_utf8 = b"\x0a\x03w3\xff"  # field 1 (prompt), 3 bytes, not UTF-8
    for data in (bad_utf8, b"\xff\xff\xff\xff", b"\x0a\x7f"):
        for stream in (False, True):
            code, details = raw_grpc(served, "GenerateStream" if stream else "Generate", data, stream=stream)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid backoff.GenerateRequest" in details
    ok = pb.GenerateRequest(prompt="w3 w4", max_tokens=2).SerializeToString()
    assert raw_grpc(served, "Generate", ok)[0] == grpc.StatusCode.OK


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
        assert raw_grpc(served, "GenerateStream", request.SerializeToString(), stream=True)[0] == code

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


def test_a_served_request_is_one_info_line_and_serve_logs_no_access_line(served):
    """Issue 57, item 8: by default one line per request, the Ingress's (its id, tokens, backoff
    rate, latency), unary or streamed; Serve's access lines (the proxy's per request, a
    replica's per call: `METHOD ROUTE STATUS 1.2ms`) are off (serve_config.yaml's logging_config)."""
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    before = {p: p.stat().st_size for p in logs.rglob("*.log") if p.is_file()}
    ids = []
    for stream in (False, True):
        body = {"prompt": W, "max_tokens": 3, "ignore_eos": True, "router": "always-large", "stream": stream}
        response = post(served, body)
        assert response.status_code == 200, response.text
        first = response.text.split("\n")[0].removeprefix("data: ") if stream else response.text
        ids.append(json.loads(first)["id"])

    def new_lines() -> list[str]:
        out = []
        for path in (p for p in logs.rglob("*.log") if p.is_file()):
            with open(path, "rb") as f:
                f.seek(before.get(path, 0))
                out += f.read().decode("utf-8", "replace").splitlines()
        return out

    deadline = time.monotonic() + 30
    while not all(any(i in line for line in new_lines()) for i in ids) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(1.0)  # an access line would come within this
    lines = new_lines()
    for request_id in ids:
        mine = [line for line in lines if request_id in line]
        assert len(mine) == 1 and mine[0].startswith("INFO") and "3 generated tokens, backoff rate 0.00" in mine[0], (
            mine
        )
    access = [line for line in lines if re.search(r"\b(GET|POST|CALL) \S+ \S+ \d+\.\dms$", line)]
    assert not access, access[:5]
