"""Core records -> wire bodies (OpenAI JSON and protobuf); a stream's SSE text is sse.py's.
No Ray, no torch."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from backoff_core.types import GenerationResult, Logprob, TokenEvent, TokenLogprobs
from clients.wire import backoff_pb2 as pb
from clients.wire.logprobs import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs
from clients.wire.openai import (
    UNASKED_IDS,
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


@dataclass(frozen=True)
class ReplyShape:
    """What a request asked to be added to OpenAI's response shapes."""

    include_usage: bool = False  # stream_options.include_usage: a stream ends with choices [] and the usage
    token_ids: bool = False  # vLLM's return_token_ids: the choices' (and the prompt's) token ids
    ids_as_tokens: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens 'token_id:{id}'

    @classmethod
    def of(cls, body) -> ReplyShape:
        """An OpenAI request body's (openai_requests._OpenAIRequest)."""
        options = body.stream_options
        return cls(
            include_usage=bool(body.stream and options is not None and options.include_usage),
            token_ids=body.return_token_ids,
            ids_as_tokens=body.return_tokens_as_token_ids,
        )

    @property
    def exclude(self) -> dict | None:
        """model_dump's exclude for a stream chunk: its token-id fields unless asked."""
        return None if self.token_ids else UNASKED_IDS


PLAIN = ReplyShape()


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


def _token(t: Logprob, as_ids: bool) -> str:
    """A logprob entry's token: its text, or 'token_id:{id}' (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{t.token_id}" if as_ids else t.token


def _chat_top(t: Logprob, as_ids: bool = False) -> ChatTopLogprob:
    if as_ids:  # vLLM's: the bytes of the name it gives
        name = _token(t, True)
        return ChatTopLogprob(token=name, logprob=t.logprob, bytes=list(name.encode()))
    return ChatTopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token_bytes))


def chat_logprobs(entries: tuple[TokenLogprobs, ...] | None, as_ids: bool = False) -> ChatLogprobs | None:
    """OpenAI chat's choice.logprobs (top_logprobs: the n most likely, most likely first, as
    OpenAI defines them); entry i's source is backoff.sources[i] (or the chunk's backoff.source)."""
    if entries is None:
        return None
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **_chat_top(e.chosen, as_ids).model_dump(), top_logprobs=[_chat_top(t, as_ids) for t in e.top]
            )
            for e in entries
        ]
    )


def completion_logprobs(entries: tuple[TokenLogprobs, ...] | None, as_ids: bool = False) -> CompletionLogprobs | None:
    """OpenAI completions' choice.logprobs: per token the sampled token first, then the top-n
    (up to n + 1 entries, as OpenAI says; first, as vLLM puts it); offsets into the generated text."""
    if entries is None:
        return None
    tops = []
    for e in entries:
        top: dict[str, float] = {}
        for t in (e.chosen, *e.top):  # a text shared by two ids keeps the first (the sampled token's)
            top.setdefault(_token(t, as_ids), t.logprob)
        tops.append(top)
    return CompletionLogprobs(
        tokens=[_token(e.chosen, as_ids) for e in entries],
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


def request_line(request_id: str, results: Sequence[GenerationResult], seconds: float) -> str:
    """The one INFO line the Ingress logs per request it answered (choices summed)."""
    u = usage_of(results[0]) if len(results) == 1 else summed_usage(results)
    choices = f" in {len(results)} choices" if len(results) > 1 else ""
    degraded = f", degraded: {u.degraded_reason}" if u.degraded else ""
    return (
        f"request {request_id}: {u.prompt_tokens} prompt + {u.completion_tokens} generated tokens{choices}, "
        f"backoff rate {u.backoff_rate:.2f} ({u.small_tokens} small, {u.large_tokens} large, "
        f"{u.large_calls} large calls), {seconds * 1e3:.0f} ms{degraded}"
    )


def chat_body(
    request_id: str,
    model: str,
    created: int,
    results: Sequence[GenerationResult],
    shape: ReplyShape = PLAIN,
    prompt_ids: Sequence[int] | None = None,
) -> dict:
    """A unary chat completion of one choice or n: choice i is result i's; usage sums them.
    prompt_ids: the chat template's (shape.token_ids)."""
    choices = [
        ChatChoice(
            index=i,
            message=ChatMessageOut(content=r.text),
            finish_reason=r.finish_reason.value,
            backoff=_trace(r),
            logprobs=chat_logprobs(r.logprobs, shape.ids_as_tokens),
            token_ids=list(r.token_ids) if shape.token_ids else None,
        )
        for i, r in enumerate(results)
    ]
    usage = usage_of(results[0]) if len(results) == 1 else summed_usage(results)
    body = ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)
    if shape.token_ids and prompt_ids is not None:
        body.prompt_token_ids = list(prompt_ids)
    return json_safe(body.model_dump())


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


def chunk_body(
    request_id: str,
    model: str,
    created: int,
    event: TokenEvent,
    chat: bool,
    choice: int = 0,
    shape: ReplyShape = PLAIN,
    prompt_ids: Sequence[int] | None = None,
) -> dict:
    """One token's chunk; prompt_ids: the choice's first chunk's (shape.token_ids)."""
    ids = [event.token_id] if shape.token_ids else None
    prompt = list(prompt_ids) if shape.token_ids and prompt_ids is not None else None
    trace = TokenTrace(
        token_id=event.token_id,
        source=event.source,
        index=event.index,
        retracted=event.retracted,
        retracted_text=event.retracted_text,
    )
    if chat:
        delta = ChatDelta(role="assistant" if event.index == 0 else None, content=event.text)
        lp = chat_logprobs(_event_logprobs(event), shape.ids_as_tokens)
        one_chat = ChatChunkChoice(index=choice, delta=delta, backoff=trace, logprobs=lp, token_ids=ids)
        chunk = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[one_chat])
        chunk.prompt_token_ids = prompt
        return json_safe(chunk.model_dump(exclude=shape.exclude))
    lp = completion_logprobs(_event_logprobs(event), shape.ids_as_tokens)
    one = CompletionChunkChoice(
        index=choice, text=event.text, backoff=trace, logprobs=lp, token_ids=ids, prompt_token_ids=prompt
    )
    return json_safe(
        CompletionChunk(id=request_id, created=created, model=model, choices=[one]).model_dump(exclude=shape.exclude)
    )


def final_chunk_body(
    request_id: str, model: str, created: int, result: GenerationResult, chat: bool, choice: int = 0
) -> dict:
    """A choice's last chunk: no token, its finish_reason, usage null (the usage comes in
    sse.usage_chunk, when stream_options.include_usage asks: OpenAI's rule)."""
    reason = result.finish_reason.value
    if chat:
        last_chat = ChatChunkChoice(index=choice, delta=ChatDelta(), finish_reason=reason)
        chunk = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[last_chat])
    else:
        last = CompletionChunkChoice(index=choice, finish_reason=reason)
        chunk = CompletionChunk(id=request_id, created=created, model=model, choices=[last])
    return json_safe(chunk.model_dump(exclude=UNASKED_IDS))


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
    admitted: the request's outcomes.Admitted (its prompt ids and text)."""
    text = (result.prompt_text if result is not None else None) or admitted.prompt_text or ""
    return pb.GenerateChunk(id=request_id, text=text, **pb_prompt(result, admitted.prompt_ids))


def pb_final_chunk(request_id: str, result: GenerationResult) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        id=request_id, finish_reason=result.finish_reason.value, usage=usage_to_pb(usage_of(result))
    )
