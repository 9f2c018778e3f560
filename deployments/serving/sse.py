"""A stream's server-sent events: the `data:` framing of a JSON body, one stream's token
chunks as SSE text (TokenChunks: the envelope built once per stream), a streamed chat
completion (ChatStream) and stream_options.include_usage's last event. The bodies are
formats.py's. No Ray, no torch."""

from __future__ import annotations

import json
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii

from backoff_core.types import GenerationResult, TokenEvent
from clients.wire.openai import UNASKED_IDS, ChatCompletionChunk, CompletionChunk
from deployments.serving.formats import (
    PLAIN,
    ReplyShape,
    chunk_body,
    final_chunk_body,
    json_safe,
    summed_usage,
    usage_of,
)


class TokenChunks:
    """One stream's token chunks as SSE text, one `data:` event per token (OpenAI clients
    count on that), the events of a batch in one string. The body is chunk_body's: the
    envelope is built once per stream, and its SSE text once, split where a token's own
    values go; a token joins those pieces with its values as JSON scalars (~2 µs; pydantic
    and json_safe per token ~45, a copied dict through json.dumps ~15). A first token or one
    with logprobs goes through chunk_body whole."""

    FIELDS = ("text", "token_id", "source", "index", "retracted", "retracted_text")  # a token's own

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        chat: bool,
        choice: int = 0,
        shape: ReplyShape = PLAIN,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self.request_id, self.model, self.created, self.chat = request_id, model, created, chat
        self.choice = choice  # the choice's index (a batch's prompt)
        self.shape = shape  # token_ids: every chunk its own ids (through chunk_body: an opt-in's cost)
        self.prompt_ids = prompt_ids  # on the first token's chunk (shape.token_ids), unless sent before it
        self.template = chunk_body(request_id, model, created, TokenEvent(0, 0, "", 1), chat, choice, shape)
        marks = {f: json.dumps(f"\x00{f}\x00") for f in self.FIELDS}  # "\u0000text\u0000": in no envelope
        text = sse(self._fill(**{f: f"\x00{f}\x00" for f in self.FIELDS}))
        at = sorted((text.index(m), f) for f, m in marks.items())
        self._order = tuple(f for _, f in at)  # the fields as json.dumps wrote them
        pieces, pos = [], 0
        for i, f in at:
            pieces.append(text[pos:i])
            pos = i + len(marks[f])
        self._pieces = (*pieces, text[pos:])  # len(FIELDS) + 1: the text around the values

    def _fill(self, **values) -> dict:
        """The template with a token's own values (a fresh dict: the template is shared)."""
        body, choice = dict(self.template), dict(self.template["choices"][0])
        body["choices"] = [choice]
        if self.chat:
            choice["delta"] = {**choice["delta"], "content": values.pop("text")}
        else:
            choice["text"] = values.pop("text")
        choice["backoff"] = {**choice["backoff"], **values}
        return body

    def body(self, event: TokenEvent) -> dict:
        if event.index == 0 or event.logprobs is not None or self.shape.token_ids:
            prompt = self.prompt_ids if event.index == 0 else None
            return chunk_body(
                self.request_id, self.model, self.created, event, self.chat, self.choice, self.shape, prompt
            )
        return self._fill(**{f: getattr(event, f) for f in self.FIELDS})

    def sse(self, events: tuple[TokenEvent, ...]) -> str:
        out: list[str] = []
        for e in events:
            if e.index == 0 or e.logprobs is not None or self.shape.token_ids:
                out.append(sse(self.body(e)))
                continue
            out.append(self._pieces[0])
            for field, piece in zip(self._order, self._pieces[1:]):
                out += (_scalar(getattr(e, field)), piece)
        return "".join(out)


class ChatStream:
    """A streamed chat completion's SSE text, in the interface of completions.CompletionStream
    that the Ingress drives: each choice's chunks carry its `index` and its last chunk its
    finish_reason; with stream_options.include_usage one more chunk ends the stream, with no
    choice and the usage (summed over n choices), as OpenAI's. prompt_ids: the chat template's
    (return_token_ids: on each choice's first chunk)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        choices: int = 1,
        shape: ReplyShape = PLAIN,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self.request_id, self.model, self.created, self.shape = request_id, model, created, shape
        self.chunks = [
            TokenChunks(request_id, model, created, chat=True, choice=i, shape=shape, prompt_ids=prompt_ids)
            for i in range(choices)
        ]
        self.results: list[GenerationResult | None] = [None] * choices

    def start(self) -> str:
        return ""

    def tokens(self, i: int, events: tuple[TokenEvent, ...]) -> str:
        return self.chunks[i].sse(events)

    def finished(self, i: int, result: GenerationResult) -> str:
        self.results[i] = result
        return sse(final_chunk_body(self.request_id, self.model, self.created, result, True, choice=i))

    def end(self) -> str:
        if not self.shape.include_usage:
            return ""
        return usage_chunk(self.request_id, self.model, self.created, self.results, chat=True)


def _scalar(value) -> str:
    """A str or int as json.dumps writes it (ASCII, escaped); anything else through json.dumps."""
    if type(value) is int:
        return int.__repr__(value)
    if type(value) is str:
        return encode_basestring_ascii(value)
    return json.dumps(value, allow_nan=False)


def sse(body: dict) -> str:
    """One server-sent event of a JSON body (json_safe'd: a NaN or inf left in is an error)."""
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"


def usage_chunk(
    request_id: str, model: str, created: int, results: Sequence[GenerationResult | None], chat: bool
) -> str:
    """stream_options.include_usage's last event: no choice, the usage (summed over a batch's
    prompts and n choices), once every choice has finished; '' before that."""
    if any(r is None for r in results):
        return ""
    kind = ChatCompletionChunk if chat else CompletionChunk
    usage = usage_of(results[0]) if len(results) == 1 else summed_usage(results)
    chunk = kind(id=request_id, created=created, model=model, choices=[], usage=usage)
    return sse(json_safe(chunk.model_dump(exclude=UNASKED_IDS)))
