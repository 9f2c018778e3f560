"""Log-probabilities on the wire: OpenAI's chat and completions shapes, and the record every
client returns (`TokenLogprob`, the same over HTTP and gRPC).

What they are (backoff_core/engine/logprobs.py): each generated token's log-probability under the
raw next-token distribution (log_softmax of the logits at temperature 1, before temperature,
top-k and top-p) of the model that produced it, its *source*, and the most likely tokens of
that same distribution. -inf is reported as -9999.0. The source of entry i is the choice's
`backoff.sources[i]` (a stream chunk: its `backoff.source`; gRPC: `sources[i]` / `source`).
No Ray, no torch.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

MAX_TOP_LOGPROBS = 20  # = backoff_core.types.MAX_TOP_LOGPROBS (clients import no core)


class TopLogprob(BaseModel):
    """One token of the source model's distribution."""

    token: str = Field(description="the token alone as text (bytes of a split character as \\xNN escapes)")
    logprob: float = Field(description="log-probability under the source model's raw distribution (T = 1); >= -9999.0")
    bytes: list[int] | None = Field(None, description="the token's exact bytes (HTTP completions do not carry them)")
    token_id: int | None = Field(None, description="the token id (gRPC only)")


class TokenLogprob(TopLogprob):
    """A generated token's log-probability and the most likely alternatives, most likely first."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list, description="the top-n of the same distribution")


# -- OpenAI chat: choice.logprobs = {"content": [...]} --------------------------------------
class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = Field(
        None, description="one entry per generated token (a stream chunk: its own token's)"
    )


# -- OpenAI completions: parallel lists ------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(
        default_factory=list, description="null only for the first prompt token of an echo (nothing predicts it)"
    )
    top_logprobs: list[dict[str, float] | None] = Field(
        default_factory=list,
        description="per token: the sampled token first, then the top-n (up to n + 1 entries, as OpenAI; "
        "in vLLM's order); null where token_logprobs is",
    )
    text_offset: list[int] = Field(
        default_factory=list,
        description="where each token's text starts in the choice's text (with echo: the prompt's, then the generated)",
    )


def from_chat(logprobs: dict | None) -> list[TokenLogprob] | None:
    if not logprobs or logprobs.get("content") is None:
        return None
    return [TokenLogprob(**entry) for entry in logprobs["content"]]


def from_completion(logprobs: dict | None, top_n: int | None = None) -> list[TokenLogprob | None] | None:
    """top_n: the count asked for, to drop the sampled token where it is not among the top-n
    (the server lists it first, as vLLM; the rest most likely first). An entry without a
    log-probability (an echoed prompt's first token) is None."""
    if not logprobs:
        return None
    out: list[TokenLogprob | None] = []
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        if value is None:
            out.append(None)
            continue
        ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])  # stable: ties keep the server's order
        alternatives = [TopLogprob(token=t, logprob=v) for t, v in ranked]
        out.append(
            TokenLogprob(
                token=token, logprob=value, top_logprobs=alternatives if top_n is None else alternatives[:top_n]
            )
        )
    return out


def from_choice(choice: dict, token_ids: list[int], top_n: int | None) -> list[TokenLogprob] | None:
    """A choice's (or chunk choice's) logprobs in either OpenAI shape; token_ids: the chosen
    tokens' ids from our `backoff` trace (OpenAI's shapes carry no ids)."""
    entries = from_completion(choice.get("logprobs"), top_n) if "text" in choice else from_chat(choice.get("logprobs"))
    if entries is not None and len(entries) == len(token_ids):
        entries = [None if e is None else e.model_copy(update={"token_id": t}) for e, t in zip(entries, token_ids)]
    return entries
