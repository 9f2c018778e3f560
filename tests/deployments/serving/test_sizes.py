"""The answer-size estimate and its refusal (deployments/serving/sizes.py), the message caps
it is kept under (AppArgs.max_message_bytes, serve_cli.SERVE_PATH_ENV, app.message_env)."""

from __future__ import annotations

import json

import pytest

from backoff_core.types import FinishReason, GenerationResult, Logprob, Timings, TokenLogprobs
from clients.wire.types import GenerateParams
from deployments import serve_cli
from deployments.serving.access import ClientError
from deployments.serving.config import AppArgs
from deployments.serving.edge_config import LimitsConfig
from deployments.serving.formats import chat_body
from deployments.serving.sizes import answer_bytes, check_answer, token_bytes


def _result(tokens: int, top: int) -> GenerationResult:
    """A result of `tokens` tokens of 3 characters, each with `top` alternatives."""
    entry = TokenLogprobs(
        Logprob(262, " th", b" th", -1.2345678),
        tuple(Logprob(300 + i, f" w{i}", f" w{i}".encode(), -2.3456789 - i) for i in range(top)),
        0,
    )
    n = tokens
    return GenerationResult(
        "r", " th" * n, (262,) * n, (0,) * n, 2, FinishReason.LENGTH, 3, (), 0, Timings(0, (), (), 0, 0),
        logprobs=(entry,) * n,
    )  # fmt: skip


def test_the_estimate_bounds_the_chat_body_of_n_choices_with_top_logprobs():
    """The issue's request: n=32 x 100 tokens x top_logprobs 20 (a 4.95 MB body there): the
    estimate is above the body built here, and within 1.5x of it."""
    results = [_result(100, 20) for _ in range(32)]
    body = len(json.dumps(chat_body("chatcmpl-1", "backoff", 0, results)).encode())
    params = GenerateParams(max_tokens=100, logprobs=20)
    estimate = answer_bytes(params, [{"messages": []}], 32, 64)
    assert body < estimate < 1.5 * body, (body, estimate)
    check_answer(LimitsConfig(), params, [{"messages": []}], 32, 64)  # within the default: admitted


def test_an_answer_past_the_limit_is_a_400_naming_its_fields():
    params = GenerateParams(max_tokens=4096, logprobs=20)
    with pytest.raises(ClientError) as refused:
        check_answer(LimitsConfig(), params, [{"messages": []}], 32, 64)
    err = refused.value
    assert err.status == 400 and err.code == "answer_too_large" and err.param == "logprobs"
    for says in ("n=32", "max_tokens=4096", "20 alternatives", "limits.max_answer_bytes", "64 MiB"):
        assert says in err.message, err.message
    # echo counts the prompt: ids exactly, text by its UTF-8 bytes (a token is at least one)
    echo = GenerateParams(max_tokens=0, logprobs=20, echo=True)
    assert answer_bytes(echo, [{"prompt": list(range(8000))}], 1, 64) == 8000 * token_bytes(20)
    assert answer_bytes(echo, [{"prompt": "é" * 10}], 1, 64) == 20 * token_bytes(20)
    with pytest.raises(ClientError) as refused:
        check_answer(LimitsConfig(max_answer_bytes=1 << 20), echo, [{"prompt": list(range(8000))}], 1, 64)
    assert "echo with a prompt of up to 8000 tokens" in refused.value.message
    # without logprobs the tokens alone: the largest batch the limits allow fits
    check_answer(LimitsConfig(), GenerateParams(max_tokens=4096), [{"prompt": "x"}] * 32, 1, 64)


def test_the_message_caps_hold_the_largest_answer_twice():
    args = AppArgs()
    assert 2 * args.limits.max_answer_bytes <= args.max_message_bytes == serve_cli.MESSAGE_BYTES
    assert serve_cli.SERVE_PATH_ENV["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] == str(serve_cli.MESSAGE_BYTES)
    with pytest.raises(ValueError, match="at most half of max_message_bytes"):
        AppArgs.model_validate({"max_message_bytes": 64 << 20})
    from deployments.app import message_env  # imports Ray

    assert message_env(args) == {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(256 << 20)}
