"""Request and response types shared by every transport (HTTP, gRPC) and by the server.

Transport-neutral records a client returns: `Generation` (a finished completion) and `Delta`
(one streamed token), plus `GenerateParams` (the knobs a request may set) and the wire scalars
they are made of. The OpenAI-compatible JSON bodies of the HTTP ingress, built on them, are
in openai_requests.py.
Names follow DESIGN.md §6: small/large, source, threshold, backoff rate.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from clients.wire.errors import from_validation
from clients.wire.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from clients.wire.prompts import field_error


def _unicode(text: str) -> str:
    # JSON may spell a lone surrogate ("\ud800"); no tokenizer takes one, and UTF-8 has none
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (a lone surrogate such as \\ud800 is not)") from None
    return text


# Wire scalars are typed strictly: "5" is not a number, 1 is not a boolean, NaN and
# infinities are not numbers (Python's JSON parser reads NaN / Infinity). A float field
# still takes an int, as JSON does not tell 1 from 1.0.
Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Bool = Annotated[bool, Field(strict=True)]
Unicode = Annotated[str, Field(strict=True), AfterValidator(_unicode)]
Text = Annotated[Unicode, Field(min_length=1)]
TokenId = Annotated[Int, Field(ge=0, lt=2**31)]  # the vocabulary's own bound is the SmallModel's to check
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries of one logit_bias (OpenAI's cap)
LOGIT_BIAS_MAX = 100.0  # a bias's range, OpenAI's


def _bias_key(key: str) -> str:
    """A logit_bias key: a token id written in decimal (JSON's keys are strings), < 2^31."""
    if not (key.isascii() and key.isdigit() and int(key) < 2**31):
        raise ValueError(f"logit_bias keys are token ids (decimal, in [0, 2^31)), got {key!r}")
    return key


LogitBias = dict[
    Annotated[str, Field(strict=True), AfterValidator(_bias_key)],
    Annotated[Float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)],
]

# Numeric ranges are decided here, at the edge, so that every accepted value is computed
# finitely inside (logits are float32: 1/T, or a threshold of 1e308, would overflow there).
TEMPERATURE_MAX = 2.0  # OpenAI's range: [0, 2]
THRESHOLD_MAX = 1e38  # |threshold| stays finite in float32 (its max is ~3.4e38)
UINT32_MAX = 2**32 - 1  # top_k: the gRPC field's range (any k >= the vocabulary keeps every token)


def _threshold(value: float) -> float:
    if abs(value) > THRESHOLD_MAX:
        raise ValueError(f"a threshold must lie in [-1e38, 1e38] (finite in float32), got {value:g}")
    return value


Threshold = Annotated[Float, AfterValidator(_threshold)]


def _one_or_many(value):
    # the wire takes one number for a two-model chain; inside it is always a list
    if isinstance(value, bool) or not isinstance(value, (int, float, list, tuple)):
        raise ValueError("must be a number, or a list of numbers (one per boundary between models, ascending)")
    return [value] if isinstance(value, (int, float)) else value


# thresholds as the wire (and the Serve config) sends them: a number, or a list, one per
# boundary; that they ascend is backoff_core.types.parse_thresholds' to check (the server's
# edge calls it: clients/ may not import the core, and a second copy of the rule would drift)
Thresholds = Annotated[list[Threshold], Field(min_length=1), BeforeValidator(_one_or_many)]


def refuse_both_spellings(data, name: str, old: str):
    """A model's `mode="before"` check for a field renamed from `old` to `name` (both accepted):
    both given is refused rather than one silently winning; a null one of the two is dropped."""
    if not isinstance(data, dict) or name not in data or old not in data:
        return data
    if data[name] is not None and data[old] is not None:
        raise ValueError(f"give {name} or its deprecated spelling {old}, not both")
    unset = old if data[old] is None else name
    return {k: v for k, v in data.items() if k != unset}


class NullIsDefault(BaseModel):
    """OpenAI reads an explicit null in an optional field as "use the default": so do we
    (a required field's null stays an error)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or (k in fields and fields[k].is_required())}


def _text_parts(parts: list) -> str:
    """OpenAI's content parts [{"type": "text", "text": ...}, ...] -> their texts joined in
    order; any other part type (image_url, input_audio, file, ...) is refused by name."""
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            if isinstance(kind, str):
                raise ValueError(f"content part {i} has type {kind!r}: only 'text' parts are supported")
            raise ValueError(f'content part {i} must be an object with "type": "text"')
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"content part {i} (type 'text') needs a string 'text'")
        texts.append(text)
    return "".join(texts)


# ----------------------------------------------------------------------------------------
# transport-neutral
# ----------------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    role: Text = Field(
        description="who speaks: system, developer, user, assistant, or any role the model's chat template "
        "knows (passed to the template as given, as vLLM does; the template may refuse it)"
    )
    content: Unicode = Field(
        description="the message text (may be empty), or OpenAI's list of content parts: "
        "text parts are joined in order, other part types are refused"
    )

    @field_validator("content", mode="before")
    @classmethod
    def _join_parts(cls, v):
        return _text_parts(v) if isinstance(v, list) else v


class GenerateParams(NullIsDefault):
    """What one request may set; None (or a JSON null) leaves the server's default (or live config)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: Int | None = Field(
        None, ge=0, description="tokens to generate at most (0: none, only with echo: score the prompt)"
    )
    temperature: Float | None = Field(None, ge=0.0, le=TEMPERATURE_MAX, description="0 = greedy; [0, 2] as in OpenAI")
    top_p: Float | None = Field(None, gt=0.0, le=1.0, description="nucleus sampling mass")
    min_p: Float | None = Field(
        None, ge=0.0, le=1.0, description="drop tokens under min_p x the likeliest's probability (0 = off)"
    )
    top_k: Int | None = Field(None, ge=0, le=UINT32_MAX, description="keep the k most likely tokens (0 = off)")
    seed: Int | None = Field(
        None, ge=-(2**63), lt=2**63, description="seed of this request's sampler (reproducible output; an int64)"
    )
    stop: list[Text] | None = Field(None, description="stop strings (the text is cut before them)")
    ignore_eos: Bool = Field(False, description="keep generating past the end-of-sequence token")
    stop_token_ids: list[TokenId] | None = Field(
        None,
        max_length=MAX_STOP_TOKEN_IDS,
        description="token ids that end the generation as EOS does (the token is kept), with ignore_eos too; "
        "each in the model's vocabulary",
    )
    min_tokens: Int | None = Field(
        None,
        ge=0,
        le=UINT32_MAX,
        description="tokens generated before EOS, a stop token id or a stop string may end the request (EOS and "
        "the stop ids are banned until then); at most max_tokens",
    )
    presence_penalty: Float | None = Field(
        None, ge=-2.0, le=2.0, description="subtracted once from a generated token's logit once it has appeared"
    )
    frequency_penalty: Float | None = Field(
        None, ge=-2.0, le=2.0, description="subtracted from a generated token's logit per time it has appeared"
    )
    repetition_penalty: Float | None = Field(
        None,
        ge=0.01,
        le=10.0,
        description="HF's: a seen token's logit (prompt or generated) / p where positive, * p where not; 1 = off",
    )
    logit_bias: LogitBias | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS,
        description="token id (a decimal string) -> bias in [-100, 100], added to every model's logits before "
        "temperature, top-k and top-p (-100 bans the token, 100 all but forces it); logprobs stay the raw ones",
    )
    router: Text | None = Field(None, description="decision function (router) for this request")
    thresholds: Thresholds | None = Field(
        None,
        validation_alias=AliasChoices("thresholds", "backoff_threshold"),
        description="thresholds on the router's score: a number, or a list with one per boundary between models, "
        "ascending; |threshold| <= 1e38 (backoff_threshold, its deprecated spelling, is still accepted)",
    )
    target_backoff: Float | None = Field(
        None, ge=0.0, le=1.0, description="ask for a backoff rate; a controller moves the threshold"
    )
    logprobs: Int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="report each token's log-probability under its source model's raw distribution (log_softmax "
        "at temperature 1) with this many top alternatives (0..20); None: no log-probabilities",
    )

    allowed_token_ids: list[TokenId] | None = Field(
        None,
        min_length=1,
        description="vLLM's: only these token ids may be drawn (every other id banned from every model's "
        "distribution, as a bias of -inf); each in the model's vocabulary",
    )
    truncate_prompt_tokens: Int | None = Field(
        None,
        ge=-1,
        description="vLLM's: keep only the prompt's last k tokens (after tokenizing; -1: the context window's "
        "worth); usage.prompt_tokens counts what is kept",
    )

    prefix_cache: Bool = Field(
        True,
        description="start from the longest cached prefix of the prompt (KV of prompt blocks seen before) and "
        "cache this prompt's blocks; false: prefill all of it (the output is the same either way)",
    )
    echo: Bool = Field(
        False,
        description="return the prompt before the completion; with logprobs, each prompt token's log-probability "
        "under this request's routed, teacher-forced distribution (the first token's is null)",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_thresholds_spelling(cls, data):
        return refuse_both_spellings(data, "thresholds", "backoff_threshold")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be >= 1 (the tokens kept), or -1 (the context window)")
        return v

    @model_validator(mode="after")
    def _zero_tokens_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise field_error(
                type(self).__name__, "max_tokens", 0, "max_tokens 0 generates nothing: it needs echo: true"
            )
        return self


def merge_params(params: GenerateParams | None, fields: dict) -> GenerateParams:
    """A client method's `params` with its keyword `fields` on top (both validated);
    raises BadRequestError before anything is sent."""
    try:
        extra = GenerateParams(**fields)
    except ValidationError as exc:
        raise from_validation(exc) from None
    if params is None:
        return extra
    return params.model_copy(update=extra.model_dump(exclude_unset=True)) if fields else params


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        0, description="prompt tokens whose KV the small model loaded from its prefix cache instead of prefilling them"
    )


class Usage(BaseModel):
    prompt_tokens: int = Field(0, description="tokens in the prompt")
    completion_tokens: int = Field(0, description="tokens generated")
    total_tokens: int = Field(0, description="prompt + completion")
    small_tokens: int = Field(0, description="generated tokens whose source is the small model")
    large_tokens: int = Field(0, description="generated tokens whose source is the large model")
    large_calls: int = Field(0, description="catch-ups (forward passes) of the large model for this request")
    degraded: bool = Field(
        False,
        description="a larger model failed (too slow or unavailable) during the request: "
        "every token after that came from the small model alone",
    )
    degraded_reason: str = Field("", description="why it was degraded (empty when it was not)")
    prompt_tokens_details: PromptTokensDetails = Field(
        default_factory=PromptTokensDetails, description="OpenAI's: cached_tokens (the prefix cache)"
    )

    @property
    def backoff_rate(self) -> float:
        """Share of generated tokens the small model produced."""
        return self.small_tokens / self.completion_tokens if self.completion_tokens else 0.0


class Generation(BaseModel):
    """A finished completion, whichever transport delivered it."""

    id: str = Field(description="request id")
    text: str = Field(description="generated text")
    finish_reason: str = Field(description="stop or length")
    usage: Usage = Field(description="token counts, by source")
    token_ids: list[int] = Field(default_factory=list, description="generated token ids")
    sources: list[int] = Field(default_factory=list, description="per generated token: 0 = small ... large")
    logprobs: list[TokenLogprob] | None = Field(
        None, description="per generated token, when asked (params.logprobs): under the model in `sources`"
    )
    prompt_token_ids: list[int] | None = Field(None, description="echo: the prompt (`text` starts with it)")
    prompt_logprobs: list[TokenLogprob | None] | None = Field(
        None,
        description="echo with logprobs: per prompt token under the request's routed teacher-forced "
        "distribution (the first is None); the level of each in `prompt_sources`",
    )
    prompt_sources: list[int | None] | None = Field(None, description="echo with logprobs: per prompt token")


class Delta(BaseModel):
    """One streamed token; the last delta of a stream carries finish_reason and usage."""

    id: str = Field(description="request id")
    text: str = Field("", description="text this token adds (may be empty mid UTF-8 sequence)")
    token_id: int | None = Field(None, description="the committed token")
    source: int | None = Field(None, description="level that produced it: 0 = small ... large")
    index: int | None = Field(None, description="position in the generated sequence")
    retracted: int = Field(0, description="earlier tokens a verification rollback removed")
    retracted_text: str = Field("", description="text those tokens had added")
    finish_reason: str | None = Field(None, description="set on the last delta")
    usage: Usage | None = Field(None, description="set on the last delta")
    logprobs: TokenLogprob | None = Field(
        None,
        description="this token's, when asked (params.logprobs); `retracted` drops those of the retracted tokens too",
    )
    prompt_token_ids: list[int] | None = Field(None, description="echo: set on the first delta, the prompt's")
    prompt_logprobs: list[TokenLogprob | None] | None = Field(None, description="echo: as Generation's")
    prompt_sources: list[int | None] | None = Field(None, description="echo: as Generation's")


# ----------------------------------------------------------------------------------------
# OpenAI-compatible HTTP bodies
# ----------------------------------------------------------------------------------------
