"""clients/wire without a server: request validation and its refusals, the protobuf round
trip, error mapping, stub freshness, the thresholds' old spellings. No Ray, no torch. The
clients themselves: tests/clients/test_http_client.py, test_grpc_client.py, test_cli.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from clients.wire import backoff_pb2 as pb
from clients.wire.errors import (
    BadRequestError,
    NotFoundError,
    ServerError,
    TransportError,
    describe_validation,
    from_grpc,
    from_http,
)
from clients.wire.openai_requests import ChatCompletionRequest, CompletionRequest
from clients.wire.proto import params_from_pb, prompt_from_pb, request_to_pb
from clients.wire.types import ChatMessage, GenerateParams, merge_params

ROOT = Path(__file__).resolve().parents[3]


def test_committed_stubs_match_the_proto(tmp_path):
    wire = Path("clients") / "wire"
    (tmp_path / wire).mkdir(parents=True)
    (tmp_path / wire / "backoff.proto").write_bytes((ROOT / wire / "backoff.proto").read_bytes())
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--python_out=.",
            "--grpc_python_out=.",
            str(wire / "backoff.proto"),
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in ("backoff_pb2.py", "backoff_pb2_grpc.py"):
        assert (tmp_path / wire / name).read_text() == (ROOT / wire / name).read_text(), (
            f"clients/wire/{name} is stale: regenerate it (see clients/wire/backoff.proto)"
        )


def test_clients_import_neither_ray_nor_torch():
    code = (
        "import sys, clients.http_client, clients.grpc_client, clients.cli; "
        "bad = [m for m in ('ray', 'torch') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@settings(max_examples=40, deadline=None)
@given(
    max_tokens=st.none() | st.integers(1, 4096),
    temperature=st.none() | st.floats(0, 2),
    top_p=st.none() | st.floats(0.01, 1.0),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    thresholds=st.none() | st.lists(st.floats(-1e38, 1e38), min_size=1, max_size=3),
    router=st.none() | st.sampled_from(["entropy", "max-prob", "random"]),
    target=st.none() | st.floats(0, 1),
)
def test_params_survive_the_protobuf_round_trip(max_tokens, temperature, top_p, seed, thresholds, router, target):
    params = GenerateParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        thresholds=thresholds,
        router=router,
        target_backoff=target,
        stop=["\n"],
        stop_token_ids=[0, 7, 2**31 - 1],
        logit_bias={"3": -100.0, "12": 2.5},
        min_tokens=None if max_tokens is None else max_tokens // 2,
        presence_penalty=0.5,
        frequency_penalty=-1.25,
        repetition_penalty=1.3,
        min_p=0.05,
    )
    back = params_from_pb(request_to_pb(params, prompt="hi"))
    assert back.model_dump() == params.model_dump()


def test_prompt_forms_are_exclusive():
    assert prompt_from_pb(request_to_pb(GenerateParams(), prompt=[1, 2])) == ([1, 2], None)
    _, messages = prompt_from_pb(request_to_pb(GenerateParams(), messages=[ChatMessage(role="user", content="x")]))
    assert messages == [ChatMessage(role="user", content="x")]
    with pytest.raises(ValueError):
        prompt_from_pb(pb.GenerateRequest())
    both = request_to_pb(GenerateParams(), prompt="a")
    both.prompt_ids.append(3)
    with pytest.raises(ValueError):
        prompt_from_pb(both)


def test_openai_request_validation():
    assert CompletionRequest(prompt="x", stop="\n").stop == ["\n"]
    assert CompletionRequest(prompt="x", thresholds=0.5).thresholds == [0.5]
    assert CompletionRequest(prompt="x", user="someone", logit_bias={}).prompt == "x"  # ignored extras
    for bad in ({"n": 0}, {"max_tokens": 0}, {"top_p": 0}, {"target_backoff": 1.5}, {"presence_penalty": 3}):
        with pytest.raises(ValueError):
            CompletionRequest(prompt="x", **bad)
    merged = merge_params(GenerateParams(max_tokens=5, seed=1), {"seed": 2})
    assert (merged.max_tokens, merged.seed) == (5, 2)


def _param(body: dict) -> str:
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate_json(json.dumps(body))
    return describe_validation(err.value.errors())[0]


@pytest.mark.parametrize(
    "field, bad, good",
    [
        ("temperature", [-1e-300, 2.0000001, 1e308, "1", True], [0, -0.0, 5e-324, 2]),
        ("top_p", [0, -0.0, 1.0000001, 1e308], [5e-324, 1]),
        ("top_k", [-1, 2**32, 2**70, 1.0, True], [0, 2**32 - 1]),
        ("max_tokens", [0, -5, 1.5, "3", False], [1, 2**70]),  # the configured cap refuses 2**70 in the Ingress
        ("seed", [2**63, -(2**63) - 1, 1.0], [2**63 - 1, -(2**63)]),
        ("thresholds", [1.0000001e38, -1e39, 1e308, [0.5, 1e300], [], "high", True], [1e38, -1e38, -0.0, [0.1, 0.2]]),
        ("backoff_threshold", [1.0000001e38, -1e39, 1e308, [0.5, 1e300], [], "high"], [1e38, -1e38, -0.0, [0.1, 0.2]]),
        ("target_backoff", [-1e-9, 1.0000001, 1e308], [0, 1, -0.0]),
        ("stop_token_ids", [[-1], [2**31], [1.0], [True], 5, ["5"], [0] * 65], [[0], [2**31 - 1], [], [1] * 64]),
        (
            "logit_bias",
            [{"x": 1}, {"-1": 1}, {"5": 101}, {"5": "1"}, {"2147483648": 1}, [5], {str(i): 1 for i in range(301)}],
            [{}, {"5": 100}, {"0": -100.0, "7": 0}],
        ),
        ("min_tokens", [-1, 1.0, True, 2**32], [0, 5, 2**32 - 1]),  # past max_tokens: a 400 at the Ingress
        ("n", [0, -1, 1.0, True], [1, 2, 2**40]),  # the Ingress refuses prompts x n past its limit
        ("presence_penalty", [2.0000001, -2.5, 1e308, "1"], [0, -0.0, -2, 2, 0.5]),
        ("frequency_penalty", [2.5, -3], [0, -2, 1.5]),
        ("repetition_penalty", [0, 0.0099, 10.5, -1], [0.01, 1, 1.3, 10]),
        ("min_p", [-0.1, 1.0000001, "0.1", 1e308], [0, 0.05, 1]),
    ],
)
def test_every_numeric_field_has_a_range_and_refusals_name_it(field, bad, good):
    for value in bad:
        assert _param({"prompt": "x", field: value}).split(".")[0] == field, value
    for value in good:
        CompletionRequest.model_validate_json(json.dumps({"prompt": "x", field: value}))


def test_an_explicit_null_is_the_default():
    optional = [
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "ignore_eos",
        "router",
        "thresholds",
        "backoff_threshold",
        "target_backoff",
        "model",
        "stream",
        "stream_options",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "user",
    ]
    body = CompletionRequest.model_validate_json(json.dumps({"prompt": "x", **dict.fromkeys(optional)}))
    assert body == CompletionRequest(prompt="x")
    chat = ChatCompletionRequest.model_validate_json(
        json.dumps(
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": None,
                "stream": True,
                "stream_options": {"include_usage": None},
            }
        )
    )
    assert chat.max_completion_tokens is None and chat.stream_options.include_usage is False
    assert _param({"prompt": None}) == "prompt"  # a required field's null stays an error
    assert GenerateParams(ignore_eos=None, temperature=None) == GenerateParams()


def test_content_parts_are_joined_and_other_part_types_are_named():
    def chat(content):
        return ChatCompletionRequest.model_validate_json(
            json.dumps({"messages": [{"role": "user", "content": content}]})
        )

    parts = [{"type": "text", "text": "Why is "}, {"type": "text", "text": "the sky blue?", "cache_control": {}}]
    assert chat(parts).messages[0].content == "Why is the sky blue?"
    assert chat([]).messages[0].content == ""
    for content, says in (
        ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}], "'image_url'"),
        ([{"type": "input_audio"}], "'input_audio'"),
        ([{"text": "a"}], "type"),
        (["a"], "type"),
        ([{"type": "text", "text": 5}], "string"),
        ([{"type": "text"}], "string"),
    ):
        with pytest.raises(ValidationError) as err:
            chat(content)
        param, message = describe_validation(err.value.errors())
        assert param == "messages.0.content" and says in message, message


def test_http_errors_map_by_status():
    body = json.dumps({"error": {"message": "nope", "param": "top_p"}})
    err = from_http(400, body)
    assert isinstance(err, BadRequestError) and err.message == "nope" and err.param == "top_p"
    assert isinstance(from_http(404, body), NotFoundError)
    assert isinstance(from_http(500, "boom"), ServerError)
    assert isinstance(from_http(503, ""), TransportError)


def test_grpc_errors_map_by_code():
    class Err(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "why"

    assert isinstance(from_grpc(Err(grpc.StatusCode.INVALID_ARGUMENT)), BadRequestError)
    assert isinstance(from_grpc(Err(grpc.StatusCode.UNIMPLEMENTED)), NotFoundError)
    assert isinstance(from_grpc(Err(grpc.StatusCode.UNAVAILABLE)), TransportError)
    assert isinstance(from_grpc(Err(grpc.StatusCode.INTERNAL)), ServerError)


# -- thresholds: the one name on the wire; backoff_threshold (JSON) and field 11 (protobuf) still read --


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_http_bodies_take_thresholds_or_the_old_backoff_threshold(model):
    base = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    for spelling in ("thresholds", "backoff_threshold"):
        for value, expected in ((0.5, [0.5]), ([1.0, 2.0], [1.0, 2.0])):
            body = model.model_validate_json(json.dumps({**base, spelling: value}))
            assert body.generate_params().thresholds == expected, (spelling, value)
    with_null = model.model_validate_json(json.dumps({**base, "thresholds": [1.0], "backoff_threshold": None}))
    assert with_null.thresholds == [1.0]
    with pytest.raises(ValidationError, match="not both"):  # the ingress answers 400
        model.model_validate_json(json.dumps({**base, "thresholds": [1.0], "backoff_threshold": [1.0]}))


def test_protobuf_takes_thresholds_or_the_deprecated_field_11():
    assert request_to_pb(GenerateParams(backoff_threshold=0.5), prompt="x").thresholds == [0.5]
    assert not request_to_pb(GenerateParams(thresholds=[0.5]), prompt="x").backoff_threshold  # 11 is not sent
    old, new = pb.GenerateRequest(backoff_threshold=[1.0, 2.0]), pb.GenerateRequest(thresholds=[1.0, 2.0])
    assert params_from_pb(old).thresholds == params_from_pb(new).thresholds == [1.0, 2.0]
    with pytest.raises(ValidationError, match="not both"):  # the gRPC service answers INVALID_ARGUMENT
        params_from_pb(pb.GenerateRequest(thresholds=[1.0], backoff_threshold=[1.0]))
    assert pb.GenerateRequest.DESCRIPTOR.fields_by_name["backoff_threshold"].GetOptions().deprecated
