"""The edge's rules without a cluster: API keys, client ids, per-client slots, request
limits, validation messages, unparsable gRPC bytes, and the core's own refusals of input
(threshold ranges, chat templates that raise). No Ray, no network."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from backoff_core.models.prompts import encode_chat
from clients.wire import backoff_pb2 as pb
from clients.wire.errors import describe_validation
from clients.wire.openai_requests import ChatCompletionRequest, CompletionRequest
from clients.wire.types import ChatMessage, GenerateParams
from deployments.serving.access import Access, ClientError, ClientSlots, check_limits
from deployments.serving.config import AppArgs
from deployments.serving.edge_config import AccessConfig, LimitsConfig
from deployments.serving.grpc_service import Undecodable, _lenient
from tests.support.helpers import engine_for, request
from tests.support.tiny import tiny_tokenizer


def test_without_keys_everyone_may_call_and_is_told_apart_by_host():
    access = Access(AccessConfig())
    assert not access.enabled
    assert access.client(None, ("10.0.0.7", 5123)) == access.client("Bearer x", ("10.0.0.7", 9999)) == "peer:10.0.0.7"
    assert access.client(None, "ipv4:127.0.0.1:5555") == "peer:127.0.0.1"
    assert access.client(None, "ipv6:[::1]:5555") == "peer:::1"


def test_keys_from_the_config_and_from_an_environment_variable():
    config = AccessConfig(api_keys=[SecretStr("alpha")], api_keys_env="KEYS")
    access = Access(config, environ={"KEYS": " beta, ,gamma "})
    ids = {access.client(f"Bearer {k}", None) for k in ("alpha", "beta", "gamma")}
    assert len(ids) == 3 and all(i.startswith("key:") and len(i) == 16 for i in ids)
    assert access.client("bearer   alpha", None) == access.client("Bearer alpha", None)  # scheme is case-blind
    for header in (None, "", "alpha", "Bearer", "Basic alpha", "Bearer wrong", "Bearer alphaX"):
        with pytest.raises(ClientError) as refused:
            access.client(header, ("1.2.3.4", 1))
        assert refused.value.status == 401 and refused.value.code == "invalid_api_key"
        assert "alpha" not in refused.value.message and refused.value.headers == {"WWW-Authenticate": "Bearer"}
    with pytest.raises(ValueError, match="KEYS"):
        Access(config, environ={})  # named but not set: refuse to start open


def test_keys_never_show_in_reprs_or_dumps():
    args = AppArgs(access=AccessConfig(api_keys=[SecretStr("sekrit")]))
    assert "sekrit" not in repr(args) and "sekrit" not in str(args.model_dump())
    assert "sekrit" not in args.model_dump_json()
    assert AppArgs.model_validate(args.model_dump()).access.api_keys[0].get_secret_value() == "sekrit"


def test_default_max_tokens_must_fit_the_cap():
    with pytest.raises(ValidationError, match="limits.max_tokens"):
        AppArgs(default_max_tokens=100, limits=LimitsConfig(max_tokens=50))


def test_slots_per_client_refuse_with_retry_after_and_release_once():
    slots = ClientSlots(limit=2, retry_after_s=7)
    a1, a2 = slots.take("a"), slots.take("a")
    b1 = slots.take("b")
    with pytest.raises(ClientError) as refused:
        slots.take("a")
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "7"}
    assert refused.value.kind == "rate_limit_error" and "per ingress replica" in refused.value.message
    a1()
    a1()  # idempotent: a second release frees nothing more
    assert slots.open == {"a": 1, "b": 1}
    slots.take("a")
    a2(), b1()
    assert slots.open == {"a": 1}
    assert ClientSlots(limit=None, retry_after_s=1).take("x") is not None


@pytest.mark.parametrize(
    "params, content, param, says",
    [
        (dict(max_tokens=101), {}, "max_tokens", "limits.max_tokens"),
        (dict(stop=["a", "b", "c"]), {}, "stop", "limits.max_stop"),
        (dict(stop=["abcdef"]), {}, "stop", "limits.max_stop_chars"),
        ({}, dict(prompt="x" * 51), "prompt", "limits.max_prompt_chars"),
        ({}, dict(prompt=[1] * 11), "prompt", "limits.max_prompt_tokens"),
        ({}, dict(messages=[ChatMessage(role="user", content="x" * 30)] * 2), "messages", "limits.max_prompt_chars"),
    ],
)
def test_limits_name_the_cap_that_was_passed(params, content, param, says):
    limits = LimitsConfig(max_tokens=100, max_stop=2, max_stop_chars=5, max_prompt_chars=50, max_prompt_tokens=10)
    with pytest.raises(ClientError) as refused:
        check_limits(limits, GenerateParams(**params), **content)
    assert refused.value.param == param and says in refused.value.message and refused.value.status == 400
    check_limits(limits, GenerateParams(max_tokens=100, stop=["abcde"] * 2), prompt=[1] * 10)  # at the caps: fine


def test_validation_messages_name_the_field_and_the_matching_union_branch():
    def problem(model, body):
        with pytest.raises(ValidationError) as err:
            model.model_validate(body)
        return describe_validation(err.value.errors())

    assert problem(CompletionRequest, {"prompt": []}) == (
        "prompt",
        "prompt: the batch is empty: give at least one prompt",
    )
    assert problem(CompletionRequest, {"prompt": [1, -1]}) == (
        "prompt",
        "prompt: the prompt[1] is -1; token ids are integers >= 0",
    )
    assert problem(CompletionRequest, {"prompt": "a", "backoff_threshold": [1, float("nan")]}) == (
        "backoff_threshold.1",
        "backoff_threshold.1: Input should be a finite number",
    )
    assert "a string, a list of strings, a list of token ids" in problem(CompletionRequest, {"prompt": 5})[1]
    assert problem(ChatCompletionRequest, {"messages": [{"role": "user", "content": None}]})[0] == "messages.0.content"
    assert problem(CompletionRequest, {"prompt": "a", "max_tokens": "5"})[0] == "max_tokens"  # strict: no "5"
    assert problem(CompletionRequest, {"prompt": "a", "ignore_eos": 1})[0] == "ignore_eos"


def test_grpc_bytes_that_do_not_parse_become_undecodable():
    parse = _lenient(pb.GenerateRequest)
    assert parse(pb.GenerateRequest(prompt="w3").SerializeToString()).prompt == "w3"
    for junk in (b"\x0a\x02\xff\xfe", b"\xff\xff\xff"):
        bad = parse(junk)
        assert isinstance(bad, Undecodable) and "not a valid backoff.GenerateRequest" in bad.describe()


def test_a_chat_template_that_raises_is_a_value_error():
    tok = tiny_tokenizer()
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    with pytest.raises(ValueError, match="user first"):
        encode_chat(tok, [{"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize(
    "router, thresholds, ok",
    [
        ("random", (0.5,), True),
        ("random", (1.5,), False),
        ("random", (-0.1,), False),
        ("max-prob", (1.0,), True),
        ("max-prob", (2.0,), False),
        ("entropy", (-3.0,), True),
        ("entropy", (1e9,), True),
    ],
)
def test_thresholds_out_of_the_routers_range_are_refused(pair, tokenizer, router, thresholds, ok):
    engine = engine_for(pair, tokenizer)
    req = request([3, 4], 2, router=router, thresholds=thresholds)
    if ok:
        assert engine.generate(req).token_ids
    else:
        with pytest.raises(ValueError, match=rf"{router} router must be in \["):
            engine.submit(req)
