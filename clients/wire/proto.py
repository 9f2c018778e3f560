"""Shared types <-> protobuf messages, for the gRPC clients and the server's gRPC methods."""

from __future__ import annotations

from clients.wire import backoff_pb2 as pb
from clients.wire.logprobs import TokenLogprob, TopLogprob
from clients.wire.types import ChatMessage, Delta, GenerateParams, Generation, PromptTokensDetails, Usage

_OPTIONAL = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "router",
    "target_backoff",
    "logprobs",
    "prefix_cache",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
)


def request_to_pb(
    params: GenerateParams,
    *,
    prompt: str | list[int] | None = None,
    messages: list[ChatMessage] | None = None,
    model: str | None = None,
) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(
        model=model or "",
        ignore_eos=params.ignore_eos,
        stop=params.stop or [],
        stop_token_ids=params.stop_token_ids or [],
        logit_bias={int(t): b for t, b in (params.logit_bias or {}).items()},
        thresholds=params.thresholds or [],
        echo=params.echo,
    )
    for name in _OPTIONAL:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if isinstance(prompt, str):
        msg.prompt = prompt
    elif prompt is not None:
        msg.prompt_ids.extend(prompt)
    for m in messages or []:
        msg.messages.add(role=m.role, content=m.content)
    return msg


def params_from_pb(msg: pb.GenerateRequest) -> GenerateParams:
    """Raises pydantic.ValidationError (a ValueError) on out-of-range values."""
    fields = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    # field 11 is the deprecated spelling of 16: GenerateParams reads either and refuses both
    return GenerateParams(
        **fields,
        stop=list(msg.stop) or None,
        stop_token_ids=list(msg.stop_token_ids) or None,
        logit_bias={str(t): b for t, b in sorted(msg.logit_bias.items())} or None,
        ignore_eos=msg.ignore_eos,
        thresholds=list(msg.thresholds) or None,
        backoff_threshold=list(msg.backoff_threshold) or None,
        echo=msg.echo,
    )


def prompt_from_pb(msg: pb.GenerateRequest) -> tuple[str | list[int] | None, list[ChatMessage] | None]:
    """(prompt, messages); raises ValueError unless exactly one of the three forms is set."""
    given = [bool(msg.prompt), bool(msg.prompt_ids), bool(msg.messages)]
    if sum(given) != 1:
        raise ValueError("set exactly one of prompt, prompt_ids and messages")
    if msg.messages:
        return None, [ChatMessage(role=m.role, content=m.content) for m in msg.messages]
    return (msg.prompt or list(msg.prompt_ids)), None


def usage_to_pb(usage: Usage) -> pb.Usage:
    fields = usage.model_dump(exclude={"prompt_tokens_details"})
    return pb.Usage(**fields, cached_prompt_tokens=usage.prompt_tokens_details.cached_tokens)


def usage_from_pb(msg: pb.Usage) -> Usage:
    return Usage(
        prompt_tokens=msg.prompt_tokens,
        completion_tokens=msg.completion_tokens,
        total_tokens=msg.total_tokens,
        small_tokens=msg.small_tokens,
        large_tokens=msg.large_tokens,
        large_calls=msg.large_calls,
        degraded=msg.degraded,
        degraded_reason=msg.degraded_reason,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=msg.cached_prompt_tokens),
    )


def logprob_from_pb(msg: pb.TokenLogprobs) -> TokenLogprob:
    def one(t: pb.Logprob) -> dict:
        return dict(token=t.token, logprob=t.logprob, bytes=list(t.token_bytes), token_id=t.token_id)

    return TokenLogprob(**one(msg.chosen), top_logprobs=[TopLogprob(**one(t)) for t in msg.top])


def _prompt_fields(msg: pb.GenerateResponse | pb.GenerateChunk) -> dict:
    """echo's prompt fields (the first prompt entry has no `chosen`; its source is -1)."""
    if not msg.prompt_token_ids:
        return {}
    entries = [logprob_from_pb(e) if e.HasField("chosen") else None for e in msg.prompt_logprobs]
    return dict(
        prompt_token_ids=list(msg.prompt_token_ids),
        prompt_logprobs=entries or None,
        prompt_sources=[None if s < 0 else s for s in msg.prompt_sources] or None,
    )


def generation_from_pb(msg: pb.GenerateResponse) -> Generation:
    # a request generates at least one token (but with echo): no entries means none were asked for
    return Generation(
        id=msg.id,
        text=msg.text,
        finish_reason=msg.finish_reason,
        usage=usage_from_pb(msg.usage),
        token_ids=list(msg.token_ids),
        sources=list(msg.sources),
        logprobs=[logprob_from_pb(e) for e in msg.logprobs] or None,
        **_prompt_fields(msg),
    )


def deltas_from_pb(msg: pb.GenerateChunk) -> list[Delta]:
    """A stream message's deltas: its one token (or the last chunk), or the several in `tokens`
    (which travel without the id)."""
    return [delta_from_pb(t, msg.id) for t in msg.tokens] if msg.tokens else [delta_from_pb(msg)]


def delta_from_pb(msg: pb.GenerateChunk, rid: str | None = None) -> Delta:
    if msg.finish_reason:  # the last chunk: no token, the request's summary
        return Delta(id=msg.id, finish_reason=msg.finish_reason, usage=usage_from_pb(msg.usage))
    if msg.prompt_token_ids:  # echo: the prompt, no token
        return Delta(id=msg.id if rid is None else rid, text=msg.text, **_prompt_fields(msg))
    return Delta(
        id=msg.id if rid is None else rid,
        text=msg.text,
        token_id=msg.token_id,
        source=msg.source,
        index=msg.index,
        retracted=msg.retracted,
        retracted_text=msg.retracted_text,
        logprobs=logprob_from_pb(msg.logprobs) if msg.HasField("logprobs") else None,
    )
