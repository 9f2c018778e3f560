"""The OpenAI-compatible JSON bodies of the HTTP ingress (`CompletionRequest`,
`ChatCompletionRequest`), which the server validates with: GenerateParams (types.py), the
transport-neutral knobs, plus OpenAI's own fields; what would change the answer and is not
implemented is refused by name (prompts.py)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from clients.wire.logprobs import MAX_TOP_LOGPROBS
from clients.wire.prompts import (
    REFUSED_CHAT,
    REFUSED_COMPLETIONS,
    PromptValue,
    field_error,
    parse_prompt,
    refuse_unsupported,
)
from clients.wire.types import Bool, ChatMessage, GenerateParams, Int, NullIsDefault, Unicode


class StreamOptions(NullIsDefault):
    include_usage: Bool = Field(
        False,
        description="end the stream with one more chunk: `choices: []` and the usage (every other chunk's is null)",
    )
    continuous_usage_stats: Bool = Field(False, description="vLLM's usage on every chunk: refused (only false)")

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous_usage(cls, v: bool) -> bool:
        if v:
            raise ValueError("usage on every chunk is not supported; include_usage: true sends it once, at the end")
        return v


class _OpenAIRequest(GenerateParams):
    # unknown fields (user, metadata, ...) are accepted and ignored; the OpenAI / vLLM ones
    # that would change the output and are not implemented are refused by name (prompts.py)
    model_config = ConfigDict(extra="ignore")
    _refused: ClassVar[dict] = REFUSED_COMPLETIONS

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        refuse_unsupported(cls.__name__, data, cls._refused)
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):  # OpenAI's and vLLM's rule
            raise field_error(
                cls.__name__, "stream_options", data["stream_options"], "stream_options needs stream: true"
            )
        return data

    model: Unicode | None = Field(None, description="served model name (see GET /v1/models)")
    stream: Bool = Field(False, description="stream tokens as server-sent events")
    stream_options: StreamOptions | None = Field(None, description="streaming options")
    return_token_ids: Bool = Field(
        False,
        description="vLLM's: each choice's `token_ids` (and `prompt_token_ids`: a completions choice's, chat's "
        "on the response); streamed, each chunk's own ids and the prompt's on a choice's first chunk",
    )
    return_tokens_as_token_ids: Bool = Field(
        False, description="vLLM's: logprobs name each token as 'token_id:{id}' instead of its text"
    )
    n: Int = Field(
        1,
        ge=1,
        description="choices per prompt, each sampled independently (with `seed`, choice j draws from "
        "a seed derived from (seed, j)); prompts x n within limits.max_batch_prompts",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        return [v] if isinstance(v, str) else v

    def generate_params(self) -> GenerateParams:
        """The transport-neutral knobs of this body (completions: `logprobs` is already a count)."""
        return GenerateParams(**self.model_dump(include=set(GenerateParams.model_fields)))


class CompletionRequest(_OpenAIRequest):
    prompt: PromptValue = Field(
        description="a string, a list of token ids, or a batch: a list of strings or of token-id lists "
        "(one choice per prompt, `index` in order)"
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_forms(cls, v):
        try:
            return parse_prompt(v)
        except ValueError as exc:  # its message says which item: no "Value error, " before it
            raise PydanticCustomError("value_error", str(exc)) from None


class ChatCompletionRequest(_OpenAIRequest):
    _refused: ClassVar[dict] = REFUSED_CHAT
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_completion_tokens: Int | None = Field(None, ge=1, description="newer name of max_tokens")
    # OpenAI's chat pair; GenerateParams.logprobs (a count) is their meaning for every transport
    logprobs: Bool | None = Field(None, description="return each generated token's log-probability")
    top_logprobs: Int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token (0..20); needs logprobs: true"
    )

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def generate_params(self) -> GenerateParams:
        fields = self.model_dump(include=set(GenerateParams.model_fields))
        fields["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return GenerateParams(**fields)
