"""Generated requests against the real Serve application on loopback (tiny models; the app
and its calls: tests/support/input_app.py): a few hundred fuzzed requests over both
transports never get a 5xx or INTERNAL nor restart a replica, and any body the schema
accepts is served JSON-safe while any other is a 400 naming its field.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import grpc
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("ray")

from clients.wire import backoff_pb2 as pb  # noqa: E402
from clients.wire import backoff_pb2_grpc as pb_grpc  # noqa: E402
from tests.support import input_app  # noqa: E402
from tests.support.input_app import (  # noqa: E402
    CLIENT_CODES,
    ENV_KEY,
    KEY,
    LIMITS,
    W,
    auth,
    grpc_meta,
    infos,
    openai_error,
    post,
    relaxed,
    wait_idle,
)
from tests.support.request_strategies import expected_refusal, grpc_requests, http_bodies  # noqa: E402
from tests.support.served_app import ServedApp  # noqa: E402

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)
SHARED_APP = input_app.SHARED_KEY  # the app of test_app_input*.py, deployed once for the three


@pytest.fixture(scope="module")
def served(shared_app) -> ServedApp:
    return shared_app(SHARED_APP, input_app.start)


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
    "stop_token_ids",
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
    msg.stop_token_ids.extend(draw(st.lists(st.integers(0, 60) | st.integers(0, 2**32 - 1), max_size=3)))
    biases = st.floats(allow_nan=True, allow_infinity=True) | st.floats(-100, 100)
    msg.logit_bias.update(draw(st.dictionaries(st.integers(0, 60) | st.integers(0, 2**32 - 1), biases, max_size=3)))
    msg.backoff_threshold.extend(draw(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=3)))
    msg.model = draw(st.sampled_from(["", "", "backoff", "gpt-9"]))
    msg.ignore_eos = draw(st.booleans())
    return method, msg.SerializeToString(), key


def _check_http_reply(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code != 200:
        openai_error(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), response.text
    else:
        assert response.json()["choices"], response.text


def test_fuzz_hundreds_of_bad_requests_never_fail_the_service(served):
    before = infos()
    statuses: Counter = Counter()
    codes: Counter = Counter()

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
                reply = call(data, metadata=grpc_meta(key), timeout=60)
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
    wait_idle()
    assert infos() == before  # no replica restarted
    ok = post(served, {"prompt": W, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


# -- properties: any body the schema accepts is served JSON-safe, any other is a 400 naming its field ---------


def _strict_json(text: str):
    """JSON as a strict parser reads it: NaN / Infinity (which Python writes) are not JSON."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_property_http_bodies_are_served_json_safe_or_refused_naming_the_field(served):
    with httpx.Client(base_url=served.url, timeout=60, headers=auth()) as http:

        @relaxed(90)
        @given(http_bodies())
        def check(case):
            path, body = case
            refused = expected_refusal(path, body, LIMITS["max_tokens"])
            response = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            assert response.status_code < 500, (response.status_code, response.text)
            if refused is not None:
                error = openai_error(response)
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

        @relaxed(60)
        @given(grpc_requests(), st.booleans())
        def check(request, stream):
            try:
                if stream:
                    chunks = list(stub.GenerateStream(request, metadata=grpc_meta(), timeout=60))
                    assert chunks[-1].finish_reason and chunks[-1].usage.completion_tokens >= 1
                else:
                    reply = stub.Generate(request, metadata=grpc_meta(), timeout=60)
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
