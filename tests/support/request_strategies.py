"""Hypothesis strategies over the request schema (HTTP JSON bodies and gRPC messages) for the
property tests of tests/deployments/test_app_input_fuzz.py: finite floats at the extremes of float32 and
float64, -0.0, subnormals, JSON nulls, wrong types, huge integers, content parts, unicode.

`expected_refusal` says, from the schema alone (clients/wire/types.py, the client-side model the
server validates with, plus the module's limits), which field a body must be refused for;
a body it accepts must be served (200), whatever its numbers.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st
from pydantic import ValidationError

from clients.wire import backoff_pb2 as pb
from clients.wire.errors import describe_validation
from clients.wire.openai_requests import ChatCompletionRequest, CompletionRequest

# finite floats where float32 arithmetic breaks: subnormals, 1/T overflow, beyond float32's max
EXTREME_FLOATS = st.sampled_from(
    [
        0.0,
        -0.0,
        5e-324,
        -5e-324,
        1e-300,
        1e-45,
        1e-30,
        1e-7,
        0.5,
        1.0,
        2.0,
        2.0000001,
        1e30,
        1e38,
        -1e38,
        3.4e38,
        3.5e38,
        1e308,
        -1e308,
        1.7976931348623157e308,
    ]
)
HUGE_INTS = st.sampled_from([0, 1, -1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**70])
WRONG_TYPES = st.sampled_from(["1", "", True, False, [], {}, [1.0], {"a": 1}, [None]])
UNICODE = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)


def _float_field():
    return st.none() | EXTREME_FLOATS | st.floats(allow_nan=False, allow_infinity=False) | WRONG_TYPES


def _int_field():
    return st.none() | HUGE_INTS | st.integers(-3, 5) | st.floats(-2, 2) | WRONG_TYPES


ROUTERS = ["entropy", "always-large", "always-small"]
# every optional field with its own values; the generation stays short (max_tokens <= 3, or refused)
FIELDS = {
    "temperature": _float_field(),
    "top_p": _float_field(),
    "target_backoff": _float_field(),
    "presence_penalty": _float_field(),
    "frequency_penalty": _float_field(),
    "backoff_threshold": _float_field() | st.lists(EXTREME_FLOATS, min_size=0, max_size=2),
    "top_k": _int_field(),
    "seed": _int_field(),
    "n": _int_field(),
    "max_tokens": st.none() | st.sampled_from([1, 2, 3, 0, -1, 481, 2**32, 2**70, 2.0, "2", True]),
    "stream": st.none() | st.booleans() | WRONG_TYPES,
    "ignore_eos": st.none() | st.booleans() | WRONG_TYPES,
    "router": st.none() | st.sampled_from(ROUTERS) | WRONG_TYPES,
    "stop": st.none() | st.lists(UNICODE.filter(lambda s: 0 < len(s) <= 16), max_size=2) | WRONG_TYPES,
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.none() | st.booleans()}),
    "model": st.none() | st.just("backoff"),
    "user": st.none() | UNICODE | WRONG_TYPES,
    # chat: a boolean (+ top_logprobs, which needs it true); completions: a count
    "logprobs": st.sampled_from([True, 0, 2, 20]) | st.booleans() | _int_field() | st.just(21),
    "top_logprobs": st.none() | st.integers(0, 20) | _int_field(),
}
# text parts are never blank: the tiny tokenizer makes no token of whitespace (a 400 of its own)
_PART = st.fixed_dictionaries(
    {"type": st.just("text"), "text": st.sampled_from(["w3 ", "w4", "\u00e9 \U0001f600"])}
) | st.sampled_from(
    [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}, {"type": "input_audio"}, {"text": "w3"}, "w3"]
)


@st.composite
def http_bodies(draw) -> tuple[str, dict]:
    """(path, body) with a valid prompt and any subset of the optional fields."""
    chat = draw(st.booleans())
    if chat:
        content = draw(st.sampled_from(["w3 w4", "\u00e9 \U0001f600"]) | st.lists(_PART, min_size=1, max_size=3))
        body = {"messages": [{"role": draw(st.sampled_from(["user", "system"])), "content": content}]}
    else:
        body = {"prompt": draw(st.sampled_from(["w3 w4", [3, 4, 5], "\u00e9 w3"]))}
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=6, unique=True))
    body.update({name: draw(FIELDS[name]) for name in names})
    body.setdefault("max_tokens", draw(st.integers(1, 3)))
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def expected_refusal(path: str, body: dict, max_tokens_cap: int) -> str | None:
    """None when the body must be served, else the param its 400 must name."""
    model = ChatCompletionRequest if path.endswith("chat/completions") else CompletionRequest
    try:
        request = model.model_validate_json(json.dumps(body))
    except ValidationError as exc:
        return describe_validation(exc.errors())[0] or ""
    if request.max_tokens is not None and request.max_tokens > max_tokens_cap:
        return "max_tokens"
    if request.router not in (None, *ROUTERS):  # e.g. "1": judged by the SmallModel, a 400 naming no param
        return ""
    return None


@st.composite
def grpc_requests(draw) -> pb.GenerateRequest:
    """A GenerateRequest whose numeric fields sit at the extremes their wire types allow."""
    msg = pb.GenerateRequest(max_tokens=draw(st.sampled_from([1, 2, 3, 0, 481, 2**32 - 1])))
    if draw(st.booleans()):
        msg.prompt = draw(st.sampled_from(["w3 w4", "\u00e9 w3"]))
    else:
        msg.messages.add(role="user", content=draw(st.sampled_from(["w3 w4", "\U0001f600"])))
    doubles = st.none() | EXTREME_FLOATS | st.floats(allow_nan=False, allow_infinity=False)
    for name in ("temperature", "top_p", "target_backoff"):
        value = draw(doubles)
        if value is not None:
            setattr(msg, name, value)
    for name, values in (
        ("top_k", st.sampled_from([0, 1, 2**31, 2**32 - 1])),
        ("seed", st.sampled_from([0, -1, 2**63 - 1, -(2**63)])),
    ):
        if draw(st.booleans()):
            setattr(msg, name, draw(values))
    msg.backoff_threshold.extend(draw(st.lists(EXTREME_FLOATS, max_size=1)))
    if draw(st.booleans()):
        msg.router = draw(st.sampled_from(["entropy", "always-large"]))
    if draw(st.booleans()):
        msg.logprobs = draw(st.sampled_from([0, 3, 20, 21, 2**32 - 1]))
    msg.ignore_eos = draw(st.booleans())
    return msg
