"""/v1/completions beyond one prompt, without a server: the prompt forms and their errors, the
refused OpenAI fields, a batch's caps, its streams merged as they come, summed usage and the
streamed chunks (parsed by the official `openai` package's types)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from pydantic import ValidationError

from clients.wire.errors import describe_validation
from clients.wire.openai import delta_from_chunk, generation_from_body
from clients.wire.openai_requests import ChatCompletionRequest, CompletionRequest
from clients.wire.prompts import is_batch, prompts_of
from clients.wire.proto import deltas_from_pb, generation_from_pb
from deployments.serving.access import ClientError
from deployments.serving.completions import (
    CompletionStream,
    Echo,
    PbStream,
    check_batch,
    check_choices,
    completion_body,
    tagged,
)
from deployments.serving.edge_config import LimitsConfig
from deployments.serving.formats import ReplyShape, pb_response, summed_usage
from deployments.serving.outcomes import Admitted
from tests.support.helpers import engine_for, request

pytest.importorskip("openai")
from openai.types import Completion  # noqa: E402


def _refusal(model, body) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    return describe_validation(err.value.errors())


@pytest.mark.parametrize(
    "prompt, prompts",
    [("w3 w4", ["w3 w4"]), ([5, 6], [[5, 6]]), (["w3", "w4 w5"], ["w3", "w4 w5"]), ([[5], [6, 7]], [[5], [6, 7]])],
)
def test_the_four_prompt_forms(prompt, prompts):
    body = CompletionRequest(prompt=prompt)
    assert prompts_of(body.prompt) == prompts and is_batch(body.prompt) == (len(prompts) > 1 or prompt == prompts)


@pytest.mark.parametrize(
    "prompt, says",
    [
        ([], "prompt: the batch is empty"),
        (["w3", 5], "prompt: item 1 is a token id where item 0 is a string"),
        ([[5], "w3"], "prompt: item 1 is a string where item 0 is a list"),
        ([5, [6]], "prompt: item 1 is a list where item 0 is a token id"),
        ([[5], []], "prompt: prompt 1 has no token ids"),
        ([[5], [6, -1]], "prompt: prompt 1[1] is -1; token ids are integers >= 0"),
        ([5, True], "prompt: item 1 is a bool"),
        (["w3", ""], "prompt: prompt 1 is empty"),
        ("", "prompt: the prompt is empty"),
        ([1.5], "prompt: must be a string, a list of strings"),
        ({"a": 1}, "prompt: must be a string"),
        ([None], "prompt: must be a string"),
    ],
)
def test_a_bad_prompt_says_which_item(prompt, says):
    param, message = _refusal(CompletionRequest, {"prompt": prompt})
    assert param == "prompt" and message.startswith(says), message


@pytest.mark.parametrize(
    "model, field, value",
    [
        (CompletionRequest, "best_of", 3),
        (CompletionRequest, "suffix", "x"),
        (CompletionRequest, "guided_regex", "a+"),
        (CompletionRequest, "use_beam_search", True),
        (CompletionRequest, "guided_json", {"type": "object"}),
        (CompletionRequest, "prompt_logprobs", 1),
        (ChatCompletionRequest, "response_format", {"type": "json_schema"}),
        (ChatCompletionRequest, "tools", [{"type": "function"}]),
        (ChatCompletionRequest, "tool_choice", "auto"),
        (ChatCompletionRequest, "echo", True),
        (ChatCompletionRequest, "modalities", ["text", "audio"]),
    ],
)
def test_fields_that_would_change_the_output_are_refused_by_name(model, field, value):
    content = {"prompt": "w3"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "w"}]}
    param, message = _refusal(model, {**content, field: value})
    assert param == field and message.startswith(f"{field}: ")


def test_neutral_values_and_unknown_fields_are_accepted():
    CompletionRequest(prompt="w3", best_of=1, suffix="", logit_bias={}, user="u", metadata={"a": 1})
    ChatCompletionRequest(
        messages=[{"role": "user", "content": "w"}], response_format={"type": "text"}, tools=[], tool_choice="none"
    )


def test_max_tokens_0_needs_echo():
    assert _refusal(CompletionRequest, {"prompt": "w3", "max_tokens": 0})[0] == "max_tokens"
    assert CompletionRequest(prompt="w3", max_tokens=0, echo=True).generate_params().max_tokens == 0


def test_a_batch_is_bounded_by_count_tokens_and_characters():
    limits = LimitsConfig(max_batch_prompts=3, max_batch_prompt_tokens=10, max_prompt_chars=8)
    check_batch(limits, [[1] * 5, [2] * 5, "abcd"])  # at the caps
    for prompts, says in [
        ([[1]] * 4, "the batch has 4 prompts; the limit is 3 (limits.max_batch_prompts)"),
        ([[1] * 6, [2] * 5], "11 tokens together; the limit is 10 (limits.max_batch_prompt_tokens)"),
        (["abcde", "abcd"], "9 characters together; the limit is 8 (limits.max_prompt_chars)"),
    ]:
        with pytest.raises(ClientError) as err:
            check_batch(limits, prompts)
        assert says in err.value.message and err.value.param == "prompt" and err.value.status == 400
    # n choices a prompt: each prompt counted n times
    check_batch(limits, [[1] * 5], n=2)
    check_choices(limits, 1, 3)
    for prompts, n, param, says in [
        ([[1]] * 2, 2, "n", "2 prompts x n=2 are 4 choices; the limit is 3 (limits.max_batch_prompts)"),
        ([[1] * 6], 2, "prompt", "12 tokens together (x n=2); the limit is 10"),
        (["abcde"], 2, "prompt", "10 characters together (x n=2); the limit is 8"),
    ]:
        with pytest.raises(ClientError) as err:
            check_batch(limits, prompts, n)
        assert says in err.value.message and err.value.param == param, err.value.message
    with pytest.raises(ClientError) as err:
        check_choices(limits, 1, 4)  # a chat's n
    assert err.value.message.startswith("1 prompt x n=4 are 4 choices") and err.value.param == "n"


def test_tagged_merges_streams_as_their_items_come_and_cancels_the_rest():
    async def stream(name: str, delays: list[float]):
        for i, d in enumerate(delays):
            await asyncio.sleep(d)
            yield f"{name}{i}"

    async def run():
        got = [x async for x in tagged([stream("a", [0.0, 0.05]), stream("b", [0.02, 0.0])])]
        assert got == [(0, "a0"), (1, "b0"), (1, "b1"), (0, "a1")]

        async def broken():
            yield "c0"
            raise RuntimeError("lost")

        slow = stream("s", [0.0, 10.0])
        merged = tagged([slow, broken()])
        with pytest.raises(RuntimeError, match="lost"):
            async with asyncio.timeout(2):
                [x async for x in merged]
        await slow.aclose()  # the reader was cancelled: the stream closes at once

    asyncio.run(run())


@pytest.fixture(scope="module")
def results(pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    return [engine.generate(request((3 + i, 4), 3 + i, "entropy", thresholds=(0.4,))) for i in range(3)]


def test_a_batch_body_has_one_choice_per_prompt_and_summed_usage(results):
    body = completion_body("cmpl-1", "m", 0, [(r, None) for r in results])
    parsed = Completion.model_validate(body)
    assert [c.index for c in parsed.choices] == [0, 1, 2]
    assert [c.text for c in parsed.choices] == [r.text for r in results]
    usage = summed_usage(results)
    assert parsed.usage.completion_tokens == usage.completion_tokens == 3 + 4 + 5
    assert parsed.usage.prompt_tokens == 6 and parsed.usage.total_tokens == 18
    assert usage.small_tokens + usage.large_tokens == 12


def _chunks(sse: str) -> list[dict]:
    return [json.loads(line[6:]) for line in sse.split("\n\n") if line.startswith("data: ")]


def test_a_streamed_batch_tags_chunks_with_their_choice_and_ends_with_the_usage(results, pair, tokenizer):
    engine = engine_for(pair, tokenizer)
    admitted = [Admitted(f"r{i}", 2) for i in range(3)]
    out = CompletionStream("cmpl-1", "m", 0, admitted, prompt_logprobs=False, shape=ReplyShape(include_usage=True))
    sse = out.start()
    for i in (2, 0, 1):  # in any order
        req = request((3 + i, 4), 3 + i, "entropy", thresholds=(0.4,))
        events = list(engine.stream(req))
        sse += out.tokens(i, tuple(events)) + out.finished(i, results[i])
        if i != 1:
            assert out.end() == ""  # not every choice has finished
    sse += out.end()
    chunks = _chunks(sse)
    text = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
            for i in range(3)}  # fmt: skip
    assert [text[i] for i in range(3)] == [r.text for r in results]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["usage"] is None for c in chunks[:-1])


def test_a_stream_s_usage_comes_only_when_asked_in_a_chunk_of_its_own(results):
    """OpenAI's rule: no usage unless stream_options.include_usage, and then one chunk after
    the last choice's, with `choices: []` (one prompt as a batch)."""
    for batch in (1, 2):
        for asked in (False, True):
            shape = ReplyShape(include_usage=asked)
            out = CompletionStream("cmpl-1", "m", 0, [Admitted("r", 2)] * batch, prompt_logprobs=False, shape=shape)
            chunks = _chunks("".join(out.finished(i, results[i]) for i in range(batch)) + out.end())
            assert [c["choices"][0]["finish_reason"] for c in chunks[:batch]] == ["length"] * batch
            assert all(c["usage"] is None for c in chunks[:batch])
            assert len(chunks) == batch + asked
            if asked:
                assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3 + 4 * (batch - 1)


def test_a_text_echo_streams_the_prompt_first():
    admitted = dataclasses.replace(Admitted("r", 2, (5, 6)), prompt_text="w3 w4")
    out = CompletionStream("cmpl-1", "m", 0, [admitted], prompt_logprobs=False)
    first = _chunks(out.start())
    assert first[0]["choices"][0]["text"] == "w3 w4"
    assert first[0]["choices"][0]["backoff"]["prompt_token_ids"] == [5, 6]


# -- echo --------------------------------------------------------------------------------------
PROMPT = (5, 9, 14, 3, 22)


@pytest.fixture(scope="module")
def echoed(pair, tokenizer):
    """(scored run generating 4 tokens, scored run generating none, its Admitted): entropy
    routing over the prompt, 2 alternatives per token."""
    engine = engine_for(pair, tokenizer)

    def run(max_tokens: int):
        req = request(PROMPT, 1, "entropy", thresholds=(0.4,))
        sampling = dataclasses.replace(req.sampling, max_tokens=max_tokens, logprobs=2, prompt_logprobs=2)
        return engine.generate(dataclasses.replace(req, sampling=sampling))

    text = tokenizer.decode(list(PROMPT), skip_special_tokens=True)
    return run(4), run(0), dataclasses.replace(Admitted("r", len(PROMPT), PROMPT), prompt_text=text)


def test_an_echo_body_lists_the_prompt_then_the_tokens(echoed):
    result, _, admitted = echoed
    echo = Echo.of(admitted, result)
    assert echo.text == result.prompt_text == "w3 w7 w12 w1 w20"
    body = completion_body("cmpl-1", "m", 0, [(result, echo)])
    # (the openai package's strict models refuse the null first entry its client reads fine)
    choice = body["choices"][0]
    assert choice["text"] == echo.text + result.text
    lp, n = choice["logprobs"], len(PROMPT)
    assert lp["tokens"][:n] == ["w3", *(e.chosen.token for e in result.prompt_logprobs[1:])]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == [e.chosen.logprob for e in result.prompt_logprobs[1:]]
    assert lp["token_logprobs"][n:] == [e.chosen.logprob for e in result.logprobs]
    assert lp["text_offset"][:n] == [0, *(e.text_offset for e in result.prompt_logprobs[1:])]
    assert lp["text_offset"][n:] == [len(echo.text) + e.text_offset for e in result.logprobs]
    trace = body["choices"][0]["backoff"]
    assert trace["prompt_token_ids"] == list(PROMPT) and trace["prompt_sources"] == list(result.prompt_sources)
    assert trace["prompt_sources"][0] is None and set(trace["prompt_sources"][1:]) == {0, 1}  # routed: both


def test_max_tokens_0_echoes_only_the_prompt_and_our_clients_read_it_back(echoed):
    _, result, admitted = echoed
    echo = Echo.of(admitted, result)
    body = completion_body("cmpl-1", "m", 0, [(result, echo)])
    assert body["choices"][0]["text"] == echo.text and body["usage"]["completion_tokens"] == 0
    http = generation_from_body(body, top_n=2)
    rpc = generation_from_pb(pb_response("cmpl-1", result, (echo.token_ids, echo.text)))
    for got in (http, rpc):
        assert got.text == echo.text and got.token_ids == [] and got.prompt_token_ids == list(PROMPT)
        assert got.prompt_logprobs[0] is None and got.prompt_sources == list(result.prompt_sources)
        assert [e.logprob for e in got.prompt_logprobs[1:]] == pytest.approx(
            [e.chosen.logprob for e in result.prompt_logprobs[1:]]
        )
        assert [[t.token for t in e.top_logprobs] for e in got.prompt_logprobs[1:]] == [
            [t.token for t in e.top] for e in result.prompt_logprobs[1:]
        ]
    assert rpc.prompt_logprobs[1].token_id == PROMPT[1] and http.prompt_logprobs[1].token_id == PROMPT[1]


def test_a_streamed_echo_with_logprobs_holds_the_tokens_until_the_prompts_scores(echoed, pair, tokenizer):
    result, _, admitted = echoed
    out = CompletionStream("cmpl-1", "m", 0, [admitted], prompt_logprobs=True)
    assert out.start() == ""  # the prompt's scores come with the result
    events = tuple(engine_for(pair, tokenizer).stream(request(PROMPT, 4, "entropy", thresholds=(0.4,))))
    assert out.tokens(0, events) == ""
    chunks = _chunks(out.finished(0, result))
    first = chunks[0]["choices"][0]
    assert first["text"] == "w3 w7 w12 w1 w20" and first["logprobs"]["token_logprobs"][0] is None
    assert chunks[0]["choices"][0]["backoff"]["prompt_sources"] == list(result.prompt_sources)
    assert "".join(c["choices"][0]["text"] for c in chunks) == first["text"] + result.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"] is None
    delta = delta_from_chunk(chunks[0], top_n=2)
    assert delta.prompt_token_ids == list(PROMPT) and delta.prompt_logprobs[0] is None and delta.token_id is None


def test_a_grpc_echo_stream_sends_the_prompt_first(echoed, pair, tokenizer):
    result, _, admitted = echoed
    events = tuple(engine_for(pair, tokenizer).stream(request(PROMPT, 4, "entropy", thresholds=(0.4,))))
    text_only = PbStream("cmpl-1", admitted, prompt_logprobs=False)
    first = text_only.start()
    assert len(first) == 1 and deltas_from_pb(first[0])[0].text == "w3 w7 w12 w1 w20"
    assert deltas_from_pb(first[0])[0].prompt_token_ids == list(PROMPT) and len(text_only.tokens(events)) == 1
    scored = PbStream("cmpl-1", admitted, prompt_logprobs=True)
    assert scored.start() == [] and scored.tokens(events) == []  # held until the prompt's scores
    deltas = [d for m in scored.finished(result) for d in deltas_from_pb(m)]
    assert deltas[0].prompt_logprobs[0] is None and deltas[0].prompt_sources == list(result.prompt_sources)
    assert [d.token_id for d in deltas[1:-1]] == [e.token_id for e in events]
    assert deltas[-1].finish_reason == "length"
    plain = PbStream("cmpl-1", Admitted("r", 5), prompt_logprobs=True)  # no echo: nothing held
    assert plain.start() == [] and len(plain.tokens(events)) == 1
