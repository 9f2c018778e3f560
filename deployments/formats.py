"""Core records -> wire bodies (OpenAI JSON and protobuf). No Ray, no torch."""

from __future__ import annotations

import math
import sys

from backoff_core.types import GenerationResult, TokenEvent
from clients import backoff_pb2 as pb
from clients.proto import usage_to_pb
from clients.types import (
    BackoffTrace, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
    ChatMessageOut, CompletionChoice, CompletionChunk, CompletionChunkChoice, CompletionResponse, ErrorBody,
    ErrorDetail, TokenTrace, Usage,
)


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
    return Usage(prompt_tokens=result.prompt_tokens, completion_tokens=n, total_tokens=result.prompt_tokens + n,
                 small_tokens=by_source[0], large_tokens=by_source[-1], large_calls=result.large_calls,
                 degraded=result.degraded, degraded_reason=result.degraded_reason)


def _trace(result: GenerationResult) -> BackoffTrace:
    return BackoffTrace(token_ids=list(result.token_ids), sources=list(result.sources),
                        thresholds=list(result.final_thresholds))


def response_body(rid: str, model: str, created: int, result: GenerationResult, chat: bool) -> dict:
    reason = result.finish_reason.value
    if chat:
        choice = ChatChoice(message=ChatMessageOut(content=result.text), finish_reason=reason, backoff=_trace(result))
        body = ChatCompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage_of(result))
    else:
        choice = CompletionChoice(text=result.text, finish_reason=reason, backoff=_trace(result))
        body = CompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage_of(result))
    return json_safe(body.model_dump())


def chunk_body(rid: str, model: str, created: int, event: TokenEvent, chat: bool) -> dict:
    trace = TokenTrace(token_id=event.token_id, source=event.source, index=event.index,
                       retracted=event.retracted, retracted_text=event.retracted_text)
    if chat:
        delta = ChatDelta(role="assistant" if event.index == 0 else None, content=event.text)
        return json_safe(ChatCompletionChunk(id=rid, created=created, model=model,
                                             choices=[ChatChunkChoice(delta=delta, backoff=trace)]).model_dump())
    return json_safe(CompletionChunk(id=rid, created=created, model=model,
                                     choices=[CompletionChunkChoice(text=event.text, backoff=trace)]).model_dump())


def final_chunk_body(rid: str, model: str, created: int, result: GenerationResult, chat: bool) -> dict:
    """The last chunk: no token, finish_reason and usage (whatever stream_options say)."""
    reason, usage = result.finish_reason.value, usage_of(result)
    if chat:
        choice = ChatChunkChoice(delta=ChatDelta(), finish_reason=reason)
        return json_safe(ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice],
                                             usage=usage).model_dump())
    choice = CompletionChunkChoice(finish_reason=reason)
    return json_safe(CompletionChunk(id=rid, created=created, model=model, choices=[choice], usage=usage).model_dump())


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=code)).model_dump()


def pb_response(rid: str, result: GenerationResult) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        id=rid, text=result.text, finish_reason=result.finish_reason.value, usage=usage_to_pb(usage_of(result)),
        token_ids=list(result.token_ids), sources=list(result.sources), num_levels=result.num_levels,
        thresholds=[_finite(t) for t in result.final_thresholds],  # JSON mappings of the reply stay finite
    )


def pb_chunk(rid: str, event: TokenEvent) -> pb.GenerateChunk:
    return pb.GenerateChunk(id=rid, text=event.text, token_id=event.token_id, source=event.source,
                            index=event.index, retracted=event.retracted, retracted_text=event.retracted_text)


def pb_final_chunk(rid: str, result: GenerationResult) -> pb.GenerateChunk:
    return pb.GenerateChunk(id=rid, finish_reason=result.finish_reason.value, usage=usage_to_pb(usage_of(result)))
