"""Logprobs on the wire, without a server: OpenAI's chat and completions shapes (parsed by the
official `openai` package's own types), protobuf, the edge's request mapping, and the
clients' records. The real Serve path is tested in test_serve_app.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pydantic import ValidationError

from backoff_core.engine.logprobs import LOGPROB_FLOOR
from backoff_core.types import Logprob, TokenEvent, TokenLogprobs
from clients.http_client import _body
from clients.wire.openai import delta_from_chunk, generation_from_body
from clients.wire.openai_requests import ChatCompletionRequest, CompletionRequest
from clients.wire.proto import delta_from_pb, generation_from_pb, params_from_pb, request_to_pb
from clients.wire.types import GenerateParams
from deployments.serving.formats import ReplyShape, chat_body, chunk_body, pb_chunk, pb_response, response_body
from deployments.serving.requests import serve_request
from deployments.serving.sse import ChatStream
from tests.support.helpers import engine_for, request

pytest.importorskip("openai")
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402
from openai.types.completion_choice import Logprobs  # noqa: E402


@pytest.fixture(scope="module")
def run(pair, tokenizer):
    """(result, events) of a mixed-source run that asked for 3 alternatives per token."""
    req = request((3, 4, 5, 6), 20, "entropy", thresholds=(0.4,))
    req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, logprobs=3))
    engine = engine_for(pair, tokenizer)
    events = list(engine.stream(req))
    result = engine.generate(req)
    assert set(result.sources) == {0, 1}
    return result, events


def test_chat_body_is_openais_shape_with_sources_beside(run):
    result, _ = run
    body = response_body("id", "m", 0, result, chat=True)
    parsed = ChatCompletion.model_validate(body).choices[0].logprobs.content
    assert len(parsed) == len(result.token_ids) == len(body["choices"][0]["backoff"]["sources"])
    for got, want in zip(parsed, result.logprobs):
        assert (got.token, got.logprob, bytes(got.bytes)) == (
            want.chosen.token,
            want.chosen.logprob,
            want.chosen.token_bytes,
        )
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top] and len(got.top_logprobs) == 3
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}


def test_completion_body_is_openais_shape(run):
    result, _ = run
    body = response_body("id", "m", 0, result, chat=False)
    lp = Completion.model_validate(body).choices[0].logprobs
    assert lp.tokens == [e.chosen.token for e in result.logprobs]
    assert lp.token_logprobs == [e.chosen.logprob for e in result.logprobs]
    assert lp.text_offset == [e.text_offset for e in result.logprobs]
    for top, e in zip(lp.top_logprobs, result.logprobs):
        assert list(top)[:3] == [t.token for t in e.top]  # the top-n first, most likely first
        assert top[e.chosen.token] == e.chosen.logprob  # then the sampled token where it is not among them
        assert len(top) == 3 + (e.chosen.token_id not in {t.token_id for t in e.top})
    back = generation_from_body(body, top_n=3)
    assert [len(e.top_logprobs) for e in back.logprobs] == [3] * len(result.token_ids)
    assert [e.token_id for e in back.logprobs] == list(result.token_ids)  # ids from the backoff trace


@pytest.mark.parametrize("chat", [True, False])
def test_stream_chunks_carry_their_tokens_entry(run, chat):
    result, events = run
    deltas = []
    for event in events:
        body = json.loads(json.dumps(chunk_body("id", "m", 0, event, chat), allow_nan=False))
        if chat:
            ChatCompletionChunk.model_validate(body)
        else:  # the openai package builds completion chunks unvalidated (no finish_reason): check the logprobs
            Logprobs.model_validate(body["choices"][0]["logprobs"])
        deltas.append(delta_from_chunk(body, top_n=3))
    assert [d.logprobs.logprob for d in deltas] == [e.chosen.logprob for e in result.logprobs]
    assert [d.logprobs.token_id for d in deltas] == list(result.token_ids)
    assert [d.source for d in deltas] == list(result.sources)


def test_n_chat_choices_are_indexed_in_the_body_and_the_stream_ends_with_their_summed_usage_when_asked(run):
    result, events = run
    other = dataclasses.replace(result, text=result.text[::-1])
    body = chat_body("id", "m", 0, [result, other])
    parsed = ChatCompletion.model_validate(body)
    assert [c.index for c in parsed.choices] == [0, 1]
    assert [c.message.content for c in parsed.choices] == [result.text, other.text]
    assert parsed.usage.completion_tokens == 2 * len(result.token_ids)
    assert chat_body("id", "m", 0, [result]) == response_body("id", "m", 0, result, chat=True)

    stream = ChatStream("id", "m", 0, choices=2, shape=ReplyShape(include_usage=True))
    sse = stream.tokens(1, tuple(events[:2])) + stream.tokens(0, tuple(events[:1])) + stream.finished(1, other)
    assert stream.end() == ""  # choice 0 has not finished
    sse += stream.finished(0, result) + stream.end()
    chunks = [ChatCompletionChunk.model_validate_json(line[6:]) for line in sse.split("\n\n") if line]
    assert [c.choices[0].index for c in chunks if c.choices] == [1, 1, 0, 1, 0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][3:] == ["length", "length"]
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 2 * len(result.token_ids)
    unasked = ChatStream("id", "m", 0, choices=2)  # OpenAI's rule: usage only with include_usage
    unasked.finished(1, other)
    assert ChatCompletionChunk.model_validate_json(unasked.finished(0, result)[6:]).usage is None
    assert unasked.end() == ""


def test_not_asked_is_null_everywhere(pair, tokenizer):
    result = engine_for(pair, tokenizer).generate(request((3, 4), 3))
    assert response_body("id", "m", 0, result, chat=True)["choices"][0]["logprobs"] is None
    assert response_body("id", "m", 0, result, chat=False)["choices"][0]["logprobs"] is None
    assert generation_from_pb(pb_response("id", result)).logprobs is None


def test_the_floor_is_plain_json():
    floor = Logprob(token_id=1, token="x", token_bytes=b"x", logprob=LOGPROB_FLOOR)
    entry = TokenLogprobs(chosen=floor, top=(floor,), text_offset=0)
    body = chunk_body("id", "m", 0, TokenEvent(1, 0, "x", 0, logprobs=entry), chat=True)
    assert '"logprob": -9999.0' in json.dumps(body, allow_nan=False)


def test_protobuf_round_trip(run):
    result, events = run
    back = generation_from_pb(pb_response("id", result))
    assert [e.logprob for e in back.logprobs] == pytest.approx([e.chosen.logprob for e in result.logprobs])
    assert [[t.token_id for t in e.top_logprobs] for e in back.logprobs] == [
        [t.token_id for t in e.top] for e in result.logprobs
    ]
    assert [bytes(e.bytes) for e in back.logprobs] == [e.chosen.token_bytes for e in result.logprobs]
    deltas = [delta_from_pb(pb_chunk("id", e)) for e in events]
    assert [d.logprobs.token_id for d in deltas] == list(result.token_ids)
    assert params_from_pb(request_to_pb(GenerateParams(logprobs=0), prompt="x")).logprobs == 0
    assert params_from_pb(request_to_pb(GenerateParams(), prompt="x")).logprobs is None


def test_the_edge_maps_both_openai_spellings_to_one_count():
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=msgs, logprobs=True, top_logprobs=3).generate_params().logprobs == 3
    assert ChatCompletionRequest(messages=msgs, logprobs=True).generate_params().logprobs == 0
    assert ChatCompletionRequest(messages=msgs, logprobs=False).generate_params().logprobs is None
    assert ChatCompletionRequest(messages=msgs, logprobs=None, top_logprobs=None).generate_params().logprobs is None
    assert CompletionRequest(prompt="x", logprobs=2).generate_params().logprobs == 2
    for bad in (
        dict(top_logprobs=2),
        dict(logprobs=False, top_logprobs=2),
        dict(logprobs=True, top_logprobs=21),
        dict(logprobs=1),
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(messages=msgs, **bad)
    for bad in (21, -1, True, 1.0):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="x", logprobs=bad)
    params = CompletionRequest(prompt="x", logprobs=4).generate_params()
    assert serve_request("r", params, prompt="x").sampling.logprobs == 4
    # our HTTP client speaks the chat pair on /v1/chat/completions, the count on /v1/completions
    assert _body(GenerateParams(logprobs=2), None, False, messages=msgs)["top_logprobs"] == 2
    assert _body(GenerateParams(logprobs=0), None, False, messages=msgs)["logprobs"] is True
    assert _body(GenerateParams(logprobs=2), None, False, prompt="x")["logprobs"] == 2


def test_cli_asks_for_logprobs_and_prints_what_a_rollback_leaves(capsys):
    from clients.cli import _generate, _params, _parser
    from clients.wire.logprobs import TokenLogprob
    from clients.wire.types import Delta

    args = _parser().parse_args(["generate", "x", "--stream", "--no-color", "--logprobs", "2"])
    assert _params(args) == GenerateParams(logprobs=2)

    def entry(token: str) -> TokenLogprob:
        return TokenLogprob(token=token, logprob=-0.5, top_logprobs=[{"token": token, "logprob": -0.5}])

    class Client:  # a stream whose third token retracts the second (a verification rollback)
        def stream(self, prompt, params):
            return iter(
                [
                    Delta(id="i", text="a", source=0, logprobs=entry("a")),
                    Delta(id="i", text="b", source=0, logprobs=entry("b")),
                    Delta(id="i", text="c", source=1, retracted=1, retracted_text="b", logprobs=entry("c")),
                    Delta(id="i", finish_reason="length"),
                ]
            )

    _generate(Client(), args)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "'a'" in lines[0] and "small" in lines[0]
    assert "'c'" in lines[1] and "large" in lines[1] and "'b'" not in lines[1]
