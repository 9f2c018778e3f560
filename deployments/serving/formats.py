"""Core records -> wire bodies (OpenAI JSON and protobuf). No Ray, no torch."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii

from backoff_core.types import GenerationResult, Logprob, TokenEvent, TokenLogprobs
from clients.wire import backoff_pb2 as pb
from clients.wire.logprobs import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs
from clients.wire.openai import (
    BackoffTrace,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionResponse,
    ErrorBody,
    ErrorDetail,
    TokenTrace,
)
from clients.wire.proto import usage_to_pb
from clients.wire.types import PromptTokensDetails, Usage


def json_safe(value):
    """value with no float JSON cannot hold: ±inf -> ±the largest float, NaN -> null.
    (json.dumps would write the invalid tokens Infinity / NaN, and Starlette refuses them:
    a plain-text 500 after the whole generation ran.) Every body below goes through it."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else math.copysign(sys.float_info.max, value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _finite(x: float) -> float:
    return x if math.isnan(x) else max(-sys.float_info.max, min(sys.float_info.max, x))


def usage_of(result: GenerationResult) -> Usage:
    by_source = result.tokens_by_source()
    n = len(result.token_ids)
    return Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=n,
        total_tokens=result.prompt_tokens + n,
        small_tokens=by_source[0],
        large_tokens=by_source[-1],
        large_calls=result.large_calls,
        degraded=result.degraded,
        degraded_reason=result.degraded_reason,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=result.cached_prompt_tokens),
    )


def _trace(result: GenerationResult) -> BackoffTrace:
    return BackoffTrace(
        token_ids=list(result.token_ids), sources=list(result.sources), thresholds=list(result.thresholds)
    )


def _chat_top(t: Logprob) -> ChatTopLogprob:
    return ChatTopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token_bytes))


def chat_logprobs(entries: tuple[TokenLogprobs, ...] | None) -> ChatLogprobs | None:
    """OpenAI chat's choice.logprobs; entry i's source is backoff.sources[i] (or the chunk's backoff.source)."""
    if entries is None:
        return None
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(**_chat_top(e.chosen).model_dump(), top_logprobs=[_chat_top(t) for t in e.top])
            for e in entries
        ]
    )


def completion_logprobs(entries: tuple[TokenLogprobs, ...] | None) -> CompletionLogprobs | None:
    """OpenAI completions' choice.logprobs: per token the top-n, then the sampled token where
    it is not among them (up to n + 1, as OpenAI says); offsets into the generated text."""
    if entries is None:
        return None
    tops = []
    for e in entries:
        top: dict[str, float] = {}
        for t in (*e.top, e.chosen):  # a text shared by two ids keeps the likelier one
            top.setdefault(t.token, t.logprob)
        tops.append(top)
    return CompletionLogprobs(
        tokens=[e.chosen.token for e in entries],
        token_logprobs=[e.chosen.logprob for e in entries],
        top_logprobs=tops,
        text_offset=[e.text_offset for e in entries],
    )


def _event_logprobs(event: TokenEvent) -> tuple[TokenLogprobs, ...] | None:
    return None if event.logprobs is None else (event.logprobs,)


def summed_usage(results: Sequence[GenerationResult]) -> Usage:
    """The usage of several choices (a batch's prompts, n choices): every count summed,
    degraded when any choice was."""
    usages = [usage_of(r) for r in results]
    counts = {
        f: sum(getattr(u, f) for u in usages)
        for f in ("prompt_tokens", "completion_tokens", "total_tokens", "small_tokens", "large_tokens", "large_calls")
    }
    reasons = "; ".join(dict.fromkeys(u.degraded_reason for u in usages if u.degraded_reason))
    cached = PromptTokensDetails(cached_tokens=sum(u.prompt_tokens_details.cached_tokens for u in usages))
    return Usage(
        **counts, degraded=any(u.degraded for u in usages), degraded_reason=reasons, prompt_tokens_details=cached
    )


def chat_body(request_id: str, model: str, created: int, results: Sequence[GenerationResult]) -> dict:
    """A unary chat completion of one choice or n: choice i is result i's; usage sums them."""
    choices = [
        ChatChoice(
            index=i,
            message=ChatMessageOut(content=r.text),
            finish_reason=r.finish_reason.value,
            backoff=_trace(r),
            logprobs=chat_logprobs(r.logprobs),
        )
        for i, r in enumerate(results)
    ]
    usage = usage_of(results[0]) if len(results) == 1 else summed_usage(results)
    return json_safe(
        ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage).model_dump()
    )


def response_body(request_id: str, model: str, created: int, result: GenerationResult, chat: bool) -> dict:
    reason = result.finish_reason.value
    if chat:
        return chat_body(request_id, model, created, [result])
    else:
        choice = CompletionChoice(
            text=result.text,
            finish_reason=reason,
            backoff=_trace(result),
            logprobs=completion_logprobs(result.logprobs),
        )
        body = CompletionResponse(id=request_id, created=created, model=model, choices=[choice], usage=usage_of(result))
    return json_safe(body.model_dump())


def chunk_body(request_id: str, model: str, created: int, event: TokenEvent, chat: bool, choice: int = 0) -> dict:
    trace = TokenTrace(
        token_id=event.token_id,
        source=event.source,
        index=event.index,
        retracted=event.retracted,
        retracted_text=event.retracted_text,
    )
    if chat:
        delta = ChatDelta(role="assistant" if event.index == 0 else None, content=event.text)
        one_chat = ChatChunkChoice(
            index=choice, delta=delta, backoff=trace, logprobs=chat_logprobs(_event_logprobs(event))
        )
        return json_safe(
            ChatCompletionChunk(id=request_id, created=created, model=model, choices=[one_chat]).model_dump()
        )
    one = CompletionChunkChoice(
        index=choice, text=event.text, backoff=trace, logprobs=completion_logprobs(_event_logprobs(event))
    )
    return json_safe(CompletionChunk(id=request_id, created=created, model=model, choices=[one]).model_dump())


class TokenChunks:
    """One stream's token chunks as SSE text, one `data:` event per token (OpenAI clients
    count on that), the events of a batch in one string. The body is chunk_body's: the
    envelope is built once per stream, and its SSE text once, split where a token's own
    values go; a token joins those pieces with its values as JSON scalars (~2 µs; pydantic
    and json_safe per token ~45, a copied dict through json.dumps ~15). A first token or one
    with logprobs goes through chunk_body whole."""

    FIELDS = ("text", "token_id", "source", "index", "retracted", "retracted_text")  # a token's own

    def __init__(self, request_id: str, model: str, created: int, chat: bool, choice: int = 0) -> None:
        self.request_id, self.model, self.created, self.chat = request_id, model, created, chat
        self.choice = choice  # the choice's index (a batch's prompt)
        self.template = chunk_body(request_id, model, created, TokenEvent(0, 0, "", 1), chat, choice)
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
        if event.index == 0 or event.logprobs is not None:
            return chunk_body(self.request_id, self.model, self.created, event, self.chat, self.choice)
        return self._fill(**{f: getattr(event, f) for f in self.FIELDS})

    def sse(self, events: tuple[TokenEvent, ...]) -> str:
        out: list[str] = []
        for e in events:
            if e.index == 0 or e.logprobs is not None:
                out.append(sse(self.body(e)))
                continue
            out.append(self._pieces[0])
            for field, piece in zip(self._order, self._pieces[1:]):
                out += (_scalar(getattr(e, field)), piece)
        return "".join(out)


class ChatStream:
    """A streamed chat completion's SSE text, in the interface of completions.CompletionStream
    that the Ingress drives. One choice: its last chunk has finish_reason and usage. n choices:
    each choice's chunks carry its `index` and its last chunk its finish_reason, then one chunk
    with no choice and the summed usage (as a completions batch ends)."""

    def __init__(self, request_id: str, model: str, created: int, choices: int = 1) -> None:
        self.request_id, self.model, self.created = request_id, model, created
        self.chunks = [TokenChunks(request_id, model, created, chat=True, choice=i) for i in range(choices)]
        self.results: list[GenerationResult | None] = [None] * choices

    def start(self) -> str:
        return ""

    def tokens(self, i: int, events: tuple[TokenEvent, ...]) -> str:
        return self.chunks[i].sse(events)

    def finished(self, i: int, result: GenerationResult) -> str:
        self.results[i] = result
        one = len(self.results) == 1
        return sse(final_chunk_body(self.request_id, self.model, self.created, result, True, choice=i, one=one))

    def end(self) -> str:
        return usage_chunk(self.request_id, self.model, self.created, self.results, chat=True)


def _scalar(value) -> str:
    """A str or int as json.dumps writes it (ASCII, escaped); anything else through json.dumps."""
    if type(value) is int:
        return int.__repr__(value)
    if type(value) is str:
        return encode_basestring_ascii(value)
    return json.dumps(value, allow_nan=False)


def final_chunk_body(
    request_id: str, model: str, created: int, result: GenerationResult, chat: bool, choice: int = 0, one: bool = True
) -> dict:
    """A choice's last chunk: no token, finish_reason, and its usage (whatever stream_options
    say) where it is the stream's one choice (one=False: usage_chunk sums the choices')."""
    reason, usage = result.finish_reason.value, usage_of(result) if one else None
    if chat:
        last_chat = ChatChunkChoice(index=choice, delta=ChatDelta(), finish_reason=reason)
        return json_safe(
            ChatCompletionChunk(
                id=request_id, created=created, model=model, choices=[last_chat], usage=usage
            ).model_dump()
        )
    last = CompletionChunkChoice(index=choice, finish_reason=reason)
    return json_safe(
        CompletionChunk(id=request_id, created=created, model=model, choices=[last], usage=usage).model_dump()
    )


def sse(body: dict) -> str:
    """One server-sent event of a JSON body (json_safe'd: a NaN or inf left in is an error)."""
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"


def usage_chunk(
    request_id: str, model: str, created: int, results: Sequence[GenerationResult | None], chat: bool
) -> str:
    """The event that ends a stream of several choices (a batch's prompts, n each): no choice,
    their usage summed, once every one has finished; '' before that, and for one choice."""
    if len(results) == 1 or any(r is None for r in results):
        return ""
    kind = ChatCompletionChunk if chat else CompletionChunk
    chunk = kind(id=request_id, created=created, model=model, choices=[], usage=summed_usage(results))
    return sse(json_safe(chunk.model_dump()))


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=code)).model_dump()


def pb_prompt(result: GenerationResult | None, prompt_ids: tuple[int, ...]) -> dict:
    """echo's prompt fields of a GenerateResponse / GenerateChunk (the result: its logprobs)."""
    entries = (result.prompt_logprobs if result is not None else None) or ()
    sources = (result.prompt_sources if result is not None else None) or ()
    return dict(
        prompt_token_ids=list(prompt_ids),
        prompt_logprobs=[pb.TokenLogprobs() if e is None else pb_logprobs(e) for e in entries],
        prompt_sources=[-1 if s is None else s for s in sources],
    )


def pb_response(
    request_id: str, result: GenerationResult, echo: tuple[tuple[int, ...], str] | None = None
) -> pb.GenerateResponse:
    """echo: the prompt's (ids, text): the text starts with it."""
    return pb.GenerateResponse(
        id=request_id,
        text=(echo[1] if echo else "") + result.text,
        finish_reason=result.finish_reason.value,
        usage=usage_to_pb(usage_of(result)),
        token_ids=list(result.token_ids),
        sources=list(result.sources),
        num_levels=result.num_levels,
        thresholds=[_finite(t) for t in result.thresholds],  # JSON mappings of the reply stay finite
        logprobs=[pb_logprobs(e) for e in result.logprobs or ()],
        **(pb_prompt(result, echo[0]) if echo else {}),
    )


def pb_logprobs(entry: TokenLogprobs) -> pb.TokenLogprobs:
    def one(t: Logprob) -> pb.Logprob:
        return pb.Logprob(token_id=t.token_id, token=t.token, token_bytes=t.token_bytes, logprob=t.logprob)

    return pb.TokenLogprobs(chosen=one(entry.chosen), top=[one(t) for t in entry.top], text_offset=entry.text_offset)


def pb_chunk(request_id: str, event: TokenEvent) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        id=request_id,
        text=event.text,
        token_id=event.token_id,
        source=event.source,
        index=event.index,
        retracted=event.retracted,
        retracted_text=event.retracted_text,
        logprobs=None if event.logprobs is None else pb_logprobs(event.logprobs),
    )


def pb_chunks(request_id: str, events: tuple[TokenEvent, ...]) -> pb.GenerateChunk:
    """One message for the tokens of one stream message: a token alone is pb_chunk's; several
    ride in `tokens`, in order (the inner chunks without the id)."""
    if len(events) == 1:
        return pb_chunk(request_id, events[0])
    return pb.GenerateChunk(id=request_id, tokens=[pb_chunk("", e) for e in events])


def pb_echo_chunk(request_id: str, admitted, result: GenerationResult | None) -> pb.GenerateChunk:
    """An echo stream's first chunk: the prompt (its logprobs with the result, when asked).
    admitted: the request's engine_loop.Admitted (its prompt ids and text)."""
    text = (result.prompt_text if result is not None else None) or admitted.prompt_text or ""
    return pb.GenerateChunk(id=request_id, text=text, **pb_prompt(result, admitted.prompt_ids))


def pb_final_chunk(request_id: str, result: GenerationResult) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        id=request_id, finish_reason=result.finish_reason.value, usage=usage_to_pb(usage_of(result))
    )
