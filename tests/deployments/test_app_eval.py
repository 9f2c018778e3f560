"""Evaluation tools against the real Serve application (tiny pair, loopback): prompt batches,
echo with the routed teacher-forced prompt logprobs, refused fields, bad input through the
new forms beside a good request, and lm-evaluation-harness run for real.

The app routes always-large (its config): lm-eval's loglikelihood requests carry no routing
field, and with always-large the prompt logprobs must be M_L's log-softmax exactly, so the
multiple-choice score through the server equals lm-eval's own `--model hf` on M_L.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import grpc
import httpx
import pytest
import torch

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from clients import cli  # noqa: E402
from clients.grpc_client import BackoffGrpcClient  # noqa: E402
from clients.http_client import BackoffHTTPClient  # noqa: E402
from clients.wire import backoff_pb2 as pb  # noqa: E402
from clients.wire import backoff_pb2_grpc as pb_grpc  # noqa: E402
from deployments.serving.requests import choice_seed  # noqa: E402
from tests.support.helpers import penalized_greedy  # noqa: E402
from tests.support.served_app import TINY_PAIR, ServedApp, deployment_config  # noqa: E402

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)
LIMITS = dict(max_batch_prompts=4, max_batch_prompt_tokens=1200)
CONTEXT_WINDOW = 512  # tiny_model's
GREEDY = dict(temperature=0, ignore_eos=True)  # a raw body's, or our clients' keywords
OA = dict(temperature=0, extra_body={"ignore_eos": True})  # the openai package's
USAGE = dict(stream_options={"include_usage": True})  # a stream's usage: one last chunk, no choice (OpenAI's)


def _edit(config: dict, dirs) -> None:
    config["applications"][0]["args"]["limits"].update(LIMITS)
    deployment_config(config, "SmallModel")["user_config"] = {"router": "always-large"}


@pytest.fixture(scope="module")
def served(serve_app) -> ServedApp:
    return serve_app("serve-eval", TINY_PAIR, edit=_edit)


@pytest.fixture(scope="module")
def openai_client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def _post(served, body, path="/v1/completions") -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, timeout=60)


def _small_info():
    return serve.get_deployment_handle("SmallModel", "backoff").info.remote().result(timeout_s=30)


def _large_logprobs(model_dir: str, ids: list[int]) -> list[float]:
    """M_L's log-softmax of each prompt token given the ones before it (plain transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # [S, V]
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


# -- batches ---------------------------------------------------------------------------------
def test_a_batch_answers_one_choice_per_prompt_as_the_single_prompts_do(served, openai_client):
    texts, ids = ["w3 w4", "w5 w6 w7", "w8"], [[5, 6], [7, 8, 9], [10]]
    for batch in (texts, ids):
        done = openai_client.completions.create(model="backoff", prompt=batch, max_tokens=5, **OA)
        assert [c.index for c in done.choices] == [0, 1, 2]
        singles = [openai_client.completions.create(model="backoff", prompt=p, max_tokens=5, **OA) for p in batch]
        assert [c.text for c in done.choices] == [s.choices[0].text for s in singles]
        assert done.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles) == 6
        assert done.usage.completion_tokens == 15 and done.usage.total_tokens == 21
    # the token-id batch is the same prompts as the text one (w3 is id 5 in the tiny vocabulary)
    by_text = openai_client.completions.create(model="backoff", prompt=texts, max_tokens=5, **OA)
    assert [c.text for c in by_text.choices] == [c.text for c in done.choices]


def test_a_streamed_batch_tags_each_chunk_with_its_choice_and_sums_usage(served, openai_client):
    batch = [[5, 6], [7, 8, 9], [10]]
    unary = openai_client.completions.create(model="backoff", prompt=batch, max_tokens=6, **OA)
    chunks = list(
        openai_client.completions.create(
            model="backoff", prompt=batch, max_tokens=6, stream=True, stream_options={"include_usage": True}, **OA
        )
    )
    text = {i: "" for i in range(3)}
    finished = {}
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert [text[i] for i in range(3)] == [c.text for c in unary.choices]
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens == 6


def test_a_batch_shares_the_step_loop(served):
    """Four prompts of 24 tokens go through the SmallModel together: about 24 steps, not 96."""
    before = _small_info().steps
    body = {"prompt": [[5], [6], [7], [8]], "max_tokens": 24, **GREEDY}
    response = _post(served, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 96
    steps = _small_info().steps - before
    assert steps < 48, f"{steps} steps for a batch of four: the prompts ran one after another"


# -- n choices -------------------------------------------------------------------------------
SAMPLED = dict(temperature=1.0, seed=11, extra_body={"ignore_eos": True})


def test_n_choices_are_n_requests_seeded_apart_and_choice_0_is_the_request_alone(served, openai_client):
    done = openai_client.completions.create(model="backoff", prompt=[5, 6, 7], max_tokens=8, n=3, **SAMPLED)
    assert [c.index for c in done.choices] == [0, 1, 2]
    texts = [c.text for c in done.choices]
    assert len(set(texts)) == 3, texts  # drawn apart (8 tokens over the tiny vocabulary at temperature 1)
    again = openai_client.completions.create(model="backoff", prompt=[5, 6, 7], max_tokens=8, n=3, **SAMPLED)
    assert [c.text for c in again.choices] == texts  # a seeded request gives the same n choices
    # choice j is the single request seeded choice_seed(seed, j): choice 0 the request's own seed
    for j, text in enumerate(texts):
        seed = choice_seed(11, j)
        alone = openai_client.completions.create(
            model="backoff", prompt=[5, 6, 7], max_tokens=8, **{**SAMPLED, "seed": seed}
        )
        assert alone.choices[0].text == text, j
    assert done.usage.prompt_tokens == 9 and done.usage.completion_tokens == 24


def test_a_batch_with_n_orders_prompt_i_choice_j_at_i_times_n_plus_j(served, openai_client):
    batch = [[5, 6], [7, 8, 9]]
    done = openai_client.completions.create(model="backoff", prompt=batch, max_tokens=5, n=2, **OA)
    singles = [openai_client.completions.create(model="backoff", prompt=p, max_tokens=5, **OA) for p in batch]
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    greedy = [s.choices[0].text for s in singles]
    assert [c.text for c in done.choices] == [greedy[0], greedy[0], greedy[1], greedy[1]]
    assert done.usage.prompt_tokens == 10 and done.usage.completion_tokens == 20


def test_chat_n_choices_unary_and_streamed_agree_and_the_stream_ends_with_their_usage(served, openai_client):
    messages = [{"role": "user", "content": "w3 w4"}]
    unary = openai_client.chat.completions.create(model="backoff", messages=messages, max_tokens=6, n=2, **SAMPLED)
    assert [c.index for c in unary.choices] == [0, 1]
    assert unary.choices[0].message.content != unary.choices[1].message.content
    assert unary.usage.completion_tokens == 12
    chunks = list(
        openai_client.chat.completions.create(
            model="backoff", messages=messages, max_tokens=6, n=2, stream=True, **SAMPLED, **USAGE
        )
    )
    text, finished = {0: "", 1: ""}, {}
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert [text[0], text[1]] == [c.message.content for c in unary.choices]
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens


@pytest.mark.parametrize(
    "path, body, says",
    [
        ("/v1/completions", {"prompt": "w3", "n": 5}, "1 prompt x n=5 are 5 choices"),
        ("/v1/completions", {"prompt": ["w3", "w4"], "n": 3}, "2 prompts x n=3 are 6 choices"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w3"}], "n": 5}, "n=5"),
    ],
)
def test_n_past_the_batch_limit_is_a_400_naming_n(served, path, body, says):
    for stream in (False, True):
        response = _post(served, {**body, "max_tokens": 2, "stream": stream}, path)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "n" and says in error["message"] and "limits.max_batch_prompts" in error["message"]


# -- stop token ids --------------------------------------------------------------------------
def test_stop_token_ids_end_the_answer_at_the_token_over_http_and_grpc(served, openai_client):
    plain = _post(served, {"prompt": [5, 6], "max_tokens": 12, **GREEDY}).json()["choices"][0]
    ids = plain["backoff"]["token_ids"]
    i = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # a token not seen before it
    body = {"prompt": [5, 6], "max_tokens": 12, "stop_token_ids": [ids[i]], **GREEDY}  # ignore_eos too
    stopped = _post(served, body).json()["choices"][0]
    assert stopped["backoff"]["token_ids"] == ids[: i + 1] and stopped["finish_reason"] == "stop"
    streamed = list(
        openai_client.completions.create(
            model="backoff", prompt=[5, 6], max_tokens=12, stream=True, **{**OA, "extra_body": body}
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == stopped["text"]
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.BackoffStub(channel)
        request = pb.GenerateRequest(
            prompt_ids=[5, 6], max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[ids[i]]
        )
        response = stub.Generate(request, metadata=(("application", "backoff"),), timeout=30)
        assert list(response.token_ids) == ids[: i + 1] and response.finish_reason == "stop"
        for bad in ([999], [2**31]):  # outside the vocabulary; outside an int32
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(
                    pb.GenerateRequest(prompt_ids=[5], max_tokens=2, stop_token_ids=bad),
                    metadata=(("application", "backoff"),),
                    timeout=30,
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in err.value.details()
    # min_tokens holds the stop token back for its first tokens, over HTTP and gRPC
    held = _post(served, {**body, "stop_token_ids": [ids[1]], "min_tokens": 5}).json()["choices"][0]
    assert len(held["backoff"]["token_ids"]) >= 5 and ids[1] not in held["backoff"]["token_ids"][:5]
    with grpc.insecure_channel(served.grpc_target) as channel:
        request = pb.GenerateRequest(
            prompt_ids=[5, 6], max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[ids[1]], min_tokens=5
        )
        response = pb_grpc.BackoffStub(channel).Generate(request, metadata=(("application", "backoff"),), timeout=30)
        assert list(response.token_ids) == held["backoff"]["token_ids"]
    refused = _post(served, {"prompt": [5], "max_tokens": 2, "min_tokens": 3})
    assert refused.status_code == 400 and "min_tokens must be in [0, max_tokens = 2]" in refused.text
    for bad, says in (([999], "stop_token_ids must be in [0, 48)"), ([-1], "stop_token_ids.0")):
        response = _post(served, {"prompt": [5], "max_tokens": 2, "stop_token_ids": bad})
        assert response.status_code == 400 and says in json.dumps(response.json()["error"]), response.text


# -- logit bias ------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans_tokens_over_http_and_grpc(served, openai_client):
    done = openai_client.completions.create(model="backoff", prompt=[5, 6], max_tokens=6, logit_bias={"9": 100}, **OA)
    assert done.choices[0].backoff["token_ids"] == [9] * 6
    chat = openai_client.chat.completions.create(
        model="backoff", messages=[{"role": "user", "content": "w3"}], max_tokens=4, logit_bias={"11": 100}, **SAMPLED
    )
    assert chat.choices[0].backoff["token_ids"] == [11] * 4
    # our own clients carry the sampling fields over both transports
    with BackoffHTTPClient(served.url) as http, BackoffGrpcClient(served.grpc_target, application="backoff") as rpc:
        for client in (http, rpc):
            fields = dict(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={"9": 100}, min_p=0.5)
            assert client.complete([5, 6], **fields).token_ids == [9] * 6
            stopped = client.complete([5, 6], **{**fields, "stop_token_ids": [9], "min_tokens": 3})
            # the stop id is banned for the first 3 tokens (over its +100 bias), then ends the request
            assert len(stopped.token_ids) == 4 and stopped.token_ids[3] == 9 and 9 not in stopped.token_ids[:3]
            assert stopped.finish_reason == "stop"
    plain = _post(served, {"prompt": [5, 6], "max_tokens": 8, **GREEDY}).json()["choices"][0]["backoff"]["token_ids"]
    banned = _post(served, {"prompt": [5, 6], "max_tokens": 8, "logit_bias": {str(plain[0]): -100}, **GREEDY})
    ids = banned.json()["choices"][0]["backoff"]["token_ids"]
    assert plain[0] not in ids and ids != plain
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.BackoffStub(channel)
        request = pb.GenerateRequest(prompt_ids=[5, 6], max_tokens=5, temperature=0, ignore_eos=True)
        request.logit_bias[13] = 100.0
        response = stub.Generate(request, metadata=(("application", "backoff"),), timeout=30)
        assert list(response.token_ids) == [13] * 5
        request.logit_bias[999] = 1.0  # outside the vocabulary
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(request, metadata=(("application", "backoff"),), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in err.value.details()
    for bad, says in (({"999": 1}, "logit_bias token ids must be in [0, 48)"), ({"5": 101}, "logit_bias.5")):
        response = _post(served, {"prompt": [5], "max_tokens": 2, "logit_bias": bad})
        assert response.status_code == 400 and says in json.dumps(response.json()["error"]), response.text


# -- penalties -------------------------------------------------------------------------------
def test_penalties_over_http_and_grpc_are_the_reference_decoding_of_m_l(served, openai_client):
    from transformers import AutoModelForCausalLM

    large = AutoModelForCausalLM.from_pretrained(served.model_dirs["large"]).eval()
    want = penalized_greedy(large, [5, 6], 10, presence=1.0, frequency=0.5, repetition=1.4)
    assert want != penalized_greedy(large, [5, 6], 10)  # they change this run
    done = openai_client.completions.create(
        model="backoff",
        prompt=[5, 6],
        max_tokens=10,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        **{**OA, "extra_body": {**OA["extra_body"], "repetition_penalty": 1.4}},
    )
    assert tuple(done.choices[0].backoff["token_ids"]) == want
    with grpc.insecure_channel(served.grpc_target) as channel:
        request = pb.GenerateRequest(
            prompt_ids=[5, 6],
            max_tokens=10,
            temperature=0,
            ignore_eos=True,
            presence_penalty=1.0,
            frequency_penalty=0.5,
            repetition_penalty=1.4,
        )
        response = pb_grpc.BackoffStub(channel).Generate(request, metadata=(("application", "backoff"),), timeout=30)
        assert tuple(response.token_ids) == want


def test_min_p_1_samples_the_argmax_over_http_and_grpc(served):
    greedy = _post(served, {"prompt": [5, 6], "max_tokens": 8, **GREEDY}).json()["choices"][0]["backoff"]["token_ids"]
    body = {"prompt": [5, 6], "max_tokens": 8, "temperature": 1.0, "ignore_eos": True, "seed": 4}
    sampled = _post(served, body).json()["choices"][0]["backoff"]["token_ids"]
    assert sampled != greedy  # temperature 1 alone draws apart
    only_top = _post(served, {**body, "min_p": 1.0}).json()["choices"][0]["backoff"]["token_ids"]
    assert only_top == greedy
    with grpc.insecure_channel(served.grpc_target) as channel:
        request = pb.GenerateRequest(
            prompt_ids=[5, 6], max_tokens=8, temperature=1.0, ignore_eos=True, seed=4, min_p=1.0
        )
        response = pb_grpc.BackoffStub(channel).Generate(request, metadata=(("application", "backoff"),), timeout=30)
        assert list(response.token_ids) == greedy


# -- echo ------------------------------------------------------------------------------------
def test_echo_with_max_tokens_0_is_the_prompt_scored_by_m_l(served, openai_client):
    ids = [5, 9, 14, 3, 22, 7]
    done = openai_client.completions.create(
        model="backoff", prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    choice = done.choices[0]
    lp = choice.logprobs
    assert choice.text == "w3 w7 w12 w1 w20 w5" and done.usage.completion_tokens == 0
    assert lp.tokens[0] == "w3" and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(_large_logprobs(served.model_dirs["large"], ids), abs=1e-4)
    # offsets: where each decoded prefix ends (this word-level tokenizer puts the space before a word)
    assert lp.text_offset == [0, 2, 5, 9, 12, 16]
    assert all(choice.text[o:].lstrip().startswith(t) for t, o in zip(lp.tokens, lp.text_offset))
    assert all(max(top.values()) >= v for top, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    trace = choice.model_extra["backoff"]
    assert trace["prompt_token_ids"] == ids and trace["prompt_sources"] == [None] + [1] * (len(ids) - 1)


def test_echo_with_generation_lists_the_prompt_then_the_tokens(served, openai_client):
    ids = [5, 6, 7]
    plain = openai_client.completions.create(model="backoff", prompt=ids, max_tokens=4, logprobs=1, **OA)
    done = openai_client.completions.create(model="backoff", prompt=ids, max_tokens=4, logprobs=1, echo=True, **OA)
    choice, base = done.choices[0], plain.choices[0]
    assert choice.text == "w3 w4 w5" + base.text
    assert choice.logprobs.tokens == ["w3", "w4", "w5", *base.logprobs.tokens]
    assert choice.logprobs.token_logprobs[3:] == pytest.approx(base.logprobs.token_logprobs, abs=1e-4)
    assert choice.logprobs.text_offset[3:] == [o + len("w3 w4 w5") for o in base.logprobs.text_offset]
    no_logprobs = openai_client.completions.create(model="backoff", prompt="w3 w4 w5", max_tokens=4, echo=True, **OA)
    assert no_logprobs.choices[0].text == choice.text and no_logprobs.choices[0].logprobs is None
    # a streamed echo starts with the prompt (with logprobs: once they are known), then the tokens
    for logprobs in (None, 1):
        chunks = list(
            openai_client.completions.create(
                model="backoff", prompt=ids, max_tokens=4, echo=True, logprobs=logprobs, stream=True, **OA
            )
        )
        assert chunks[0].choices[0].text == "w3 w4 w5"
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        if logprobs:
            streamed = chunks[0].choices[0].logprobs.token_logprobs
            assert streamed[0] is None and streamed[1:] == pytest.approx(choice.logprobs.token_logprobs[1:3], abs=1e-4)


def test_our_clients_and_grpc_carry_echo(served, openai_client, capsys):
    ids = [5, 9, 14, 3]
    want = _large_logprobs(served.model_dirs["large"], ids)
    with BackoffHTTPClient(served.url) as http, BackoffGrpcClient(served.grpc_target, application="backoff") as rpc:
        for c in (http, rpc):
            got = c.complete(ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
            assert got.text == "w3 w7 w12 w1" and got.prompt_token_ids == ids and got.token_ids == []
            assert got.prompt_logprobs[0] is None
            assert [e.logprob for e in got.prompt_logprobs[1:]] == pytest.approx(want, abs=1e-4)
            assert got.prompt_sources == [None, 1, 1, 1]
            more = c.complete(ids, max_tokens=3, echo=True, **GREEDY)
            assert more.text.startswith("w3 w7 w12 w1") and len(more.token_ids) == 3
            first = next(iter(c.stream(ids, max_tokens=3, echo=True, logprobs=1, **GREEDY)))
            assert first.text == "w3 w7 w12 w1" and first.prompt_token_ids == ids
            assert [e.logprob for e in first.prompt_logprobs[1:]] == pytest.approx(want, abs=1e-4)
    command = ["generate", "w3 w7 w12 w1", "--echo", "--logprobs", "1", "--max-tokens", "0", "--temperature", "0"]
    for where in (["--url", served.url], ["--grpc", served.grpc_target]):
        capsys.readouterr()
        assert cli.main([*where, *command]) == 0
        out, err = capsys.readouterr()
        assert out == "w3 w7 w12 w1\n" and err.startswith("prompt:\n")
        assert len(re.findall(r"^ +\d+ +large ", err, re.M)) == 3  # each prompt token scored by M_L, named so


# -- refused fields and bad input --------------------------------------------------------------
@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"suffix": "w9"}, "suffix"),
        ("/v1/completions", {"guided_choice": ["w3", "w4"]}, "guided_choice"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"guided_regex": "w[0-9]"}, "guided_regex"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ],
)
def test_fields_we_do_not_implement_are_refused_by_name(served, path, extra, param):
    content = {"prompt": "w3"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "w3"}]}
    response = _post(served, {**content, "max_tokens": 2, **extra}, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}:"), error


def test_neutral_values_of_those_fields_are_served(served):
    body = {"prompt": "w3", "max_tokens": 2, "best_of": 1, "suffix": "", "logit_bias": {}, "user": "x", "n": 1}
    assert _post(served, body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "w3"}], "max_tokens": 2, "response_format": {"type": "text"}}
    assert _post(served, {**chat, "tools": [], "tool_choice": "none"}, "/v1/chat/completions").status_code == 200


BAD_BATCHES = [
    ({"prompt": []}, "the batch is empty"),
    ({"prompt": ["w3", [5]]}, "item 1 is a list where item 0 is a string"),
    ({"prompt": [5, "w3"]}, "item 1 is a string where item 0 is a token id"),
    ({"prompt": [[5], []]}, "prompt 1 has no token ids"),
    ({"prompt": [[5, 6], [7, 999]]}, "prompt 1: prompt token ids must be in [0, 48)"),
    ({"prompt": [999]}, "prompt token ids must be in [0, 48)"),
    ({"prompt": [5] * 600, "echo": True, "max_tokens": 0}, "context window"),
    ({"prompt": [[5]] * 5}, "limits.max_batch_prompts"),
    ({"prompt": [[5] * 700, [6] * 700]}, "limits.max_batch_prompt_tokens"),
]


def test_bad_input_through_the_new_forms_is_a_400_and_hurts_no_other_request(served):
    pid = _small_info().pid
    good: dict = {}

    def long_request() -> None:  # a streamed request that runs through all the bad ones
        body = {"prompt": [[5, 6]], "max_tokens": 300, "stream": True, "echo": True, **GREEDY, **USAGE}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as response:
            good["lines"] = [line for line in response.iter_lines() if line.startswith("data:")]

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.5)
    for body, says in BAD_BATCHES:
        response = _post(served, {"max_tokens": 4, **body})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert says in error["message"] and error["type"] == "invalid_request_error", (body, error)
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.BackoffStub(channel)
        for request in (
            pb.GenerateRequest(prompt_ids=[999], max_tokens=2),
            pb.GenerateRequest(prompt_ids=[5] * 600, max_tokens=0, echo=True),
            pb.GenerateRequest(prompt_ids=[5], max_tokens=0),  # 0 without echo
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(request, metadata=(("application", "backoff"),), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    thread.join(timeout=120)
    events = [json.loads(line[5:]) for line in good["lines"][:-1]]
    assert good["lines"][-1] == "data: [DONE]" and events[-1]["usage"]["completion_tokens"] == 300
    assert events[0]["choices"][0]["text"] == "w3 w4"  # its echo
    assert _small_info().pid == pid  # no replica restarted


# -- lm-evaluation-harness, for real ---------------------------------------------------------------
MC_ITEMS = [
    {"question": f"w{3 + i % 7} w{10 + i % 5} w{20 + i % 3}", "choices": [f"w{30 + j + i % 4}" for j in range(4)],
     "label": i % 4}
    for i in range(16)
]  # fmt: skip
GEN_ITEMS = [{"question": f"w{3 + i} w{4 + i}", "answer": f"w{5 + i}"} for i in range(6)]


def _write_tasks(root) -> str:
    (root / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in MC_ITEMS))
    (root / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN_ITEMS))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\n"
    (root / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    (root / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['w40']\n  max_gen_toks: 3\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return str(root)


def _loglikelihoods(results: dict, task: str) -> list[list[float]]:
    return [[r[0] for r in s["filtered_resps"]] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_lm_eval_runs_against_the_server_and_scores_what_hf_scores_on_m_l(served, tmp_path, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=_write_tasks(tmp_path))
    large = served.model_dirs["large"]
    # as lm-eval's docs show it: default model_args (tokenized requests: lists of token-id lists)
    served_run = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=backoff,base_url={served.url}/v1/completions,tokenizer={large}",
        tasks=["tiny_mc", "tiny_gen"],
        task_manager=tasks,
        log_samples=True,
    )
    hf_run = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={large},device=cpu,dtype=float32",
        tasks=["tiny_mc"],
        task_manager=tasks,
        log_samples=True,
    )
    assert served_run["results"]["tiny_mc"]["acc,none"] == hf_run["results"]["tiny_mc"]["acc,none"]
    got, want = _loglikelihoods(served_run, "tiny_mc"), _loglikelihoods(hf_run, "tiny_mc")
    assert len(got) == len(MC_ITEMS) and got == [pytest.approx(w, abs=1e-4) for w in want]
    assert len({round(x, 3) for x in got[0]}) == 4  # the choices' scores differ: a real comparison
    assert "exact_match,none" in served_run["results"]["tiny_gen"]
    generated = [s["filtered_resps"][0] for s in served_run["samples"]["tiny_gen"]]
    assert len(generated) == len(GEN_ITEMS) and any(generated)

    chat_run = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=f"model=backoff,base_url={served.url}/v1/chat/completions",
        tasks=["tiny_gen"],
        task_manager=tasks,
        apply_chat_template=True,
        log_samples=True,
    )
    assert "exact_match,none" in chat_run["results"]["tiny_gen"]
    assert len(chat_run["samples"]["tiny_gen"]) == len(GEN_ITEMS)
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
