"""OpenAI-compatible response bodies (unary, stream chunks, models, errors) and their reading
back into our transport-neutral records (`Generation`, `Delta`): the shapes the server writes
and the HTTP client reads."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from clients.wire.logprobs import ChatLogprobs, CompletionLogprobs, from_choice
from clients.wire.types import Delta, Generation, Usage


class BackoffTrace(BaseModel):
    """Extension field of a choice: which model produced each token."""

    token_ids: list[int] = Field(default_factory=list, description="generated token ids")
    sources: list[int] = Field(default_factory=list, description="per token: 0 = small ... large")
    thresholds: list[float] = Field(default_factory=list, description="thresholds in force at the end")
    prompt_token_ids: list[int] | None = Field(None, description="echo: the prompt's token ids")
    prompt_sources: list[int | None] | None = Field(
        None,
        description="echo with logprobs: per prompt token, the level whose distribution scored it "
        "(null for the first); logprobs lists the prompt's tokens first",
    )


IDS = "vLLM's return_token_ids"


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = Field(None, description="when asked; sources in `backoff.sources`")
    prompt_logprobs: None = Field(None, description="always null, as vLLM's (echo + logprobs score the prompt)")
    token_ids: list[int] | None = Field(None, description=f"{IDS}: the generated ids")
    prompt_token_ids: list[int] | None = Field(None, description=f"{IDS}: the prompt's ids")
    backoff: BackoffTrace | None = Field(None, description="per-token sources (extension)")


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = Field(None, description="when asked; sources in `backoff.sources`")
    token_ids: list[int] | None = Field(None, description=f"{IDS}: the generated ids")
    backoff: BackoffTrace | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: None = Field(None, description="always null, as vLLM's")
    prompt_token_ids: list[int] | None = Field(None, description=f"{IDS}: the prompt's ids (the chat template's)")


class TokenTrace(BaseModel):
    """Extension field of a streamed choice: the token behind this chunk."""

    token_id: int
    source: int
    index: int
    retracted: int = 0
    retracted_text: str = ""


class PromptTrace(BaseModel):
    """Extension field of a stream's echo chunk (the first of its choice): the prompt."""

    prompt_token_ids: list[int]
    prompt_sources: list[int | None] | None = Field(None, description="with logprobs: as BackoffTrace's")


class CompletionChunkChoice(BaseModel):
    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = Field(None, description="this chunk's token's; source in `backoff`")
    token_ids: list[int] | None = Field(None, description=f"{IDS}: this chunk's ids (left out unless asked)")
    prompt_token_ids: list[int] | None = Field(None, description=f"{IDS}: on a choice's first chunk")
    backoff: TokenTrace | PromptTrace | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = Field(None, description="this chunk's token's; source in `backoff`")
    token_ids: list[int] | None = Field(None, description=f"{IDS}: this chunk's ids (left out unless asked)")
    backoff: TokenTrace | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(None, description=f"{IDS}: on the first chunk (left out unless asked)")


# a chunk's return_token_ids fields, left out of its JSON unless the request asked (model_dump's exclude)
UNASKED_IDS = {"choices": {"__all__": {"token_ids", "prompt_token_ids"}}, "prompt_token_ids": True}


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "backoff-serve"
    root: str | None = Field(None, description="vLLM's: what the name serves (here the large model's path or id)")
    parent: str | None = Field(None, description="vLLM's: the base model of an adapter (none here)")
    max_model_len: int | None = Field(None, description="vLLM's: prompt + generated tokens one request may hold")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


# ----------------------------------------------------------------------------------------
# OpenAI bodies -> transport-neutral records (used by the HTTP client)
# ----------------------------------------------------------------------------------------


def generation_from_body(body: dict, top_n: int | None = None) -> Generation:
    """top_n: the logprobs count asked for (completions list the sampled token after the top-n)."""
    choice = body["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    trace = choice.get("backoff") or {}
    token_ids, prompt_ids = trace.get("token_ids", []), trace.get("prompt_token_ids")
    scored = prompt_ids is not None and trace.get("prompt_sources") is not None  # echo with logprobs
    logprobs = from_choice(choice, (prompt_ids if scored else []) + token_ids, top_n)
    prompt_logprobs = None
    if scored and logprobs is not None:  # the prompt's entries come first
        prompt_logprobs, logprobs = logprobs[: len(prompt_ids)], logprobs[len(prompt_ids) :]
    return Generation(
        id=body["id"],
        text=text,
        finish_reason=choice.get("finish_reason") or "",
        usage=Usage(**body.get("usage") or {}),
        token_ids=token_ids,
        sources=trace.get("sources", []),
        logprobs=logprobs,
        prompt_token_ids=prompt_ids,
        prompt_logprobs=prompt_logprobs,
        prompt_sources=trace.get("prompt_sources") if scored else None,
    )


def delta_from_chunk(body: dict, top_n: int | None = None) -> Delta:
    usage = Usage(**body["usage"]) if body.get("usage") else None
    if not body.get("choices"):
        return Delta(id=body["id"], usage=usage)
    choice = body["choices"][0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content") or ""
    trace = choice.get("backoff") or {}
    if "prompt_token_ids" in trace:  # echo: the prompt, first
        prompt_ids = trace["prompt_token_ids"]
        return Delta(
            id=body["id"],
            text=text,
            prompt_token_ids=prompt_ids,
            prompt_logprobs=from_choice(choice, prompt_ids, top_n),
            prompt_sources=trace.get("prompt_sources"),
        )
    return Delta(
        id=body["id"],
        text=text,
        token_id=trace.get("token_id"),
        source=trace.get("source"),
        index=trace.get("index"),
        retracted=trace.get("retracted", 0),
        retracted_text=trace.get("retracted_text", ""),
        finish_reason=choice.get("finish_reason"),
        usage=usage,
        logprobs=next(iter(from_choice(choice, [trace["token_id"]] if trace else [], top_n) or []), None),
    )
