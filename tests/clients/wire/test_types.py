"""clients/ without a server: wire conversions, error mapping, SSE parsing, stub freshness,
and the gRPC client against an in-process gRPC server. No Ray, no torch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from clients.grpc_client import AsyncBackoffGrpcClient, BackoffGrpcClient
from clients.http_client import AsyncBackoffHTTPClient, BackoffHTTPClient
from clients.wire import backoff_pb2 as pb
from clients.wire import backoff_pb2_grpc as pb_grpc
from clients.wire.errors import (
    BadRequestError,
    NotFoundError,
    ServerError,
    TransportError,
    describe_validation,
    from_grpc,
    from_http,
)
from clients.wire.proto import delta_from_pb, params_from_pb, prompt_from_pb, request_to_pb
from clients.wire.types import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateParams,
    Usage,
    merge_params,
)

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
    for bad in ({"n": 2}, {"max_tokens": 0}, {"top_p": 0}, {"target_backoff": 1.5}, {"presence_penalty": 1}):
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
        ("n", [2, 0, 1.0, True], [1]),
        ("presence_penalty", [0.5, -2, 1e308], [0, -0.0]),
        ("frequency_penalty", [0.5, -2], [0]),
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


# -- HTTP client against a mock transport -------------------------------------------------

USAGE = {
    "prompt_tokens": 2,
    "completion_tokens": 2,
    "total_tokens": 4,
    "small_tokens": 1,
    "large_tokens": 1,
    "large_calls": 1,
}


def _handler(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content) if request.content else {}
    if request.url.path == "/health":
        return httpx.Response(200, json={"status": "ok"})
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "backoff", "object": "model"}]})
    if body.get("top_k") == 99:
        return httpx.Response(400, json={"error": {"message": "top_k too large", "param": "top_k"}})
    if body.get("stream"):
        chunks = [
            {"id": "c", "choices": [{"text": t, "backoff": {"token_id": i, "source": i, "index": i}}]}
            for i, t in enumerate(["a", " b"])
        ]
        chunks.append({"id": "c", "choices": [{"text": "", "finish_reason": "length"}], "usage": USAGE})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
    assert body["max_tokens"] == 2 and body["thresholds"] == [0.5] and "backoff_threshold" not in body
    choice = {"text": "a b", "finish_reason": "length", "backoff": {"token_ids": [5, 6], "sources": [0, 1]}}
    return httpx.Response(200, json={"id": "c", "choices": [choice], "usage": USAGE})


def test_http_client_parses_bodies_and_streams():
    http = httpx.Client(transport=httpx.MockTransport(_handler), base_url="http://x")
    with BackoffHTTPClient(http=http) as client:
        out = client.complete("hi", max_tokens=2, thresholds=[0.5])
        assert (out.text, out.sources, out.usage.backoff_rate) == ("a b", [0, 1], 0.5)
        deltas = list(client.stream("hi", max_tokens=2))
        assert [d.text for d in deltas] == ["a", " b", ""]
        assert [d.source for d in deltas[:2]] == [0, 1]
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage == Usage(**USAGE)
        assert client.models() == ["backoff"] and client.health()
        with pytest.raises(BadRequestError, match="top_k too large"):
            client.complete("hi", top_k=99)
        with pytest.raises(BadRequestError):
            list(client.stream("hi", top_k=99))


def test_async_http_client_has_the_same_methods():
    async def run():
        http = httpx.AsyncClient(transport=httpx.MockTransport(_handler), base_url="http://x")
        async with AsyncBackoffHTTPClient(http=http) as client:
            out = await client.complete("hi", max_tokens=2, backoff_threshold=0.5)  # the old spelling, sent new
            deltas = [d async for d in client.stream("hi")]
            return out, deltas, await client.models()

    out, deltas, models = asyncio.run(run())
    assert out.token_ids == [5, 6] and len(deltas) == 3 and models == ["backoff"]
    sync_methods = {m for m in dir(BackoffHTTPClient) if not m.startswith("_")}
    for cls in (AsyncBackoffHTTPClient, BackoffGrpcClient, AsyncBackoffGrpcClient):
        assert {m for m in dir(cls) if not m.startswith("_")} >= sync_methods - {"model", "timeout"}


def test_http_client_maps_connection_errors():
    with BackoffHTTPClient("http://127.0.0.1:9", timeout=2) as client:
        with pytest.raises(TransportError):
            client.complete("hi")
        assert client.health() is False


# -- gRPC client against an in-process server ---------------------------------------------


class FakeService(pb_grpc.BackoffServicer):
    def Generate(self, request, context):
        if request.router == "nope":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unknown router 'nope'")
        return pb.GenerateResponse(
            id="g",
            text=request.prompt.upper(),
            finish_reason="stop",
            usage=pb.Usage(completion_tokens=1),
            token_ids=[4],
            sources=[1],
        )

    def GenerateStream(self, request, context):
        for i, ch in enumerate(request.prompt):
            yield pb.GenerateChunk(id="g", text=ch, token_id=i, source=i % 2, index=i)
        yield pb.GenerateChunk(id="g", finish_reason="length", usage=pb.Usage(completion_tokens=len(request.prompt)))

    def Models(self, request, context):
        return pb.ModelsResponse(models=["backoff"])

    def Health(self, request, context):
        return pb.HealthResponse(ok=True)


@pytest.fixture(scope="module")
def grpc_target():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_BackoffServicer_to_server(FakeService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_grpc_client_round_trip(grpc_target):
    with BackoffGrpcClient(grpc_target) as client:
        out = client.complete("abc", max_tokens=3)
        assert (out.text, out.sources, out.finish_reason) == ("ABC", [1], "stop")
        deltas = list(client.stream("abc"))
        assert "".join(d.text for d in deltas) == "abc" and [d.source for d in deltas[:3]] == [0, 1, 0]
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 3
        assert deltas[-1].token_id is None
        assert client.models() == ["backoff"] and client.health()
        with pytest.raises(BadRequestError, match="unknown router"):
            client.complete("abc", router="nope")


def test_async_grpc_client_round_trip(grpc_target):
    async def run():
        async with AsyncBackoffGrpcClient(grpc_target) as client:
            out = await client.chat([{"role": "user", "content": "x"}])
            deltas = [d async for d in client.stream("hey")]
            return out, deltas

    out, deltas = asyncio.run(run())
    assert out.id == "g" and "".join(d.text for d in deltas) == "hey"


def test_last_chunk_carries_no_token():
    last = delta_from_pb(pb.GenerateChunk(id="x", finish_reason="stop", usage=pb.Usage(completion_tokens=4)))
    assert last.token_id is None and last.usage.completion_tokens == 4


def test_bad_params_are_refused_before_sending_and_the_cli_reports_them(capsys):
    from clients.cli import main

    with pytest.raises(BadRequestError, match="top_p"):
        merge_params(None, {"top_p": 5})
    assert main(["--url", "http://127.0.0.1:9", "generate", "x", "--top-p", "5"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9", "generate", "x"]) == 1  # nobody there


def test_cli_flags_become_the_request_params():
    from clients.cli import _params, _parser

    args = _parser().parse_args(
        [
            "generate",
            "x",
            "--max-tokens",
            "7",
            "--temperature",
            "0",
            "--top-k",
            "5",
            "--seed",
            "3",
            "--stop",
            "a",
            "--stop",
            "b",
            "--ignore-eos",
            "--router",
            "entropy",
            "--threshold",
            "1.5,4",
            "--target-backoff",
            "0.8",
        ]
    )
    assert _params(args) == GenerateParams(
        max_tokens=7,
        temperature=0.0,
        top_k=5,
        seed=3,
        stop=["a", "b"],
        ignore_eos=True,
        router="entropy",
        thresholds=[1.5, 4.0],
        target_backoff=0.8,
    )
    assert _params(_parser().parse_args(["generate", "x"])) == GenerateParams()
    assert _params(_parser().parse_args(["generate", "x", "--thresholds", "2"])).thresholds == [2.0]


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
