"""What a request produces: each committed token as a stream yields it (TokenEvent, with its
log-probabilities), and the result once it finishes (GenerationResult, with its catch-ups and
timings). Frozen records, as types.py's, which re-exports them. Level 0 is the smallest
model, N-1 the largest ("source" of a token = the level whose distribution it was sampled from).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"  # EOS or a stop string


class Logprob(NamedTuple):
    """A token and its log-probability under the raw next-token distribution (log_softmax
    of the logits at temperature 1) of the model that produced the step's token.

    A NamedTuple, as TokenLogprobs: a request keeps 1 + logprobs of them a token for its life
    (~200 k at 64 streams, 512 tokens and logprobs 5), built once each in the step loop; a
    tuple is built ~3x faster than a frozen dataclass and holds no instance dict."""

    token_id: int
    token: str  # the token alone as text; bytes that are no whole UTF-8 character as \xNN escapes
    token_bytes: bytes  # its exact bytes
    logprob: float  # finite: -inf (underflow, a masked logit) is logprobs.LOGPROB_FLOOR


class TokenLogprobs(NamedTuple):
    """One committed token's log-probability and the top alternatives of the same (source
    model's) distribution, most likely first; the source itself is the token's `source`.
    A NamedTuple, as Logprob."""

    chosen: Logprob
    top: tuple[Logprob, ...]  # SamplingParams.logprobs of them
    text_offset: int  # where the token's text starts in the generated text (a prompt token's: in the prompt text)


@dataclass(frozen=True, init=False)
class TokenEvent:
    """One committed token, as a stream yields it. A rollback retracts tokens: `retracted`
    is how many previously streamed tokens (and `retracted_text` of text, and their
    logprobs) this event removes before adding its own token."""

    token_id: int
    source: int
    text: str  # text this token adds once decoding is stable (may be "" mid-UTF-8)
    index: int  # position in the generated sequence
    retracted: int = 0
    retracted_text: str = ""
    logprobs: TokenLogprobs | None = None  # when the request asks (SamplingParams.logprobs)

    def __init__(
        self,
        token_id: int,
        source: int,
        text: str,
        index: int,
        retracted: int = 0,
        retracted_text: str = "",
        logprobs: TokenLogprobs | None = None,
    ) -> None:
        # Built once per request and step (64 a step at 64 streams): the generated frozen
        # __init__ sets each field through object.__setattr__ (0.83 us); filling the instance
        # dict directly costs 0.34. Same fields, order and defaults (test_types.py checks).
        d = self.__dict__
        d["token_id"], d["source"], d["text"], d["index"] = token_id, source, text, index
        d["retracted"], d["retracted_text"], d["logprobs"] = retracted, retracted_text, logprobs


@dataclass(frozen=True)
class CatchUp:
    """One M_L (or intermediate level) call: `length` pending positions in one forward."""

    level: int
    length: int
    seconds: float
    rolled_back: int = 0  # pending tokens discarded by verification
    batch_size: int = 1  # sequences that shared this forward
    prompt_tokens: int = 0  # of `length`, how many were prompt (a lazy prompt prefill)


@dataclass(frozen=True)
class Timings:
    """Seconds. c_S: small step, c_r: decision function, per step. Prefill separately."""

    prefill: float
    small_steps: tuple[float, ...]
    router_steps: tuple[float, ...]
    first_token: float
    total: float


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: tuple[int, ...]  # generated only
    sources: tuple[int, ...]  # per generated token: 0 = smallest ... N-1 = largest
    num_levels: int
    finish_reason: FinishReason
    prompt_tokens: int
    catch_ups: tuple[CatchUp, ...]
    rollbacks: int  # tokens discarded by verification, in all
    timings: Timings
    kl_at_catch_up: tuple[float, ...] = ()  # true KL(M_L||M_S) at pending positions (telemetry)
    thresholds: tuple[float, ...] = ()
    # a larger model failed to answer: every token from then on is the small model's
    degraded: bool = False
    degraded_reason: str = ""
    # per generated token (aligned with token_ids and sources) when the request asks, else None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # per PROMPT token when the request asks (SamplingParams.prompt_logprobs), else None: its
    # log-probability under the routed teacher-forced distribution (engine/prompt.py), text_offset
    # into prompt_text; the first entry is None (nothing predicts the first token)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # aligned with prompt_logprobs: the level whose distribution scored each prompt token
    prompt_sources: tuple[int | None, ...] | None = None
    prompt_text: str | None = None  # the decoded prompt the offsets index (when prompt_logprobs)
    cached_prompt_tokens: int = 0  # prompt positions M_S loaded from its prefix cache (not prefilled)

    @property
    def backoff_rate(self) -> float:
        """Share of generated tokens that the smallest model produced."""
        if not self.sources:
            return 0.0
        return sum(1 for s in self.sources if s == 0) / len(self.sources)

    @property
    def large_calls(self) -> int:
        """Forward passes of the largest model (catch-ups), the prompt prefill included."""
        return sum(1 for c in self.catch_ups if c.level == self.num_levels - 1)

    def tokens_by_source(self) -> tuple[int, ...]:
        return tuple(sum(1 for s in self.sources if s == level) for level in range(self.num_levels))
