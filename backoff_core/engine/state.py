"""Per-request bookkeeping of the step loop: committed tokens, sources, and how far each
model's lagging cache has read (`fed`). Pending tokens of level l = tokens[fed[l]:].
A Live holds, apart, what its result reports of how it ran (`Stats`) and its prompt's
logprobs when asked (`PromptScores`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

import backoff_core.engine.incremental as incremental
from backoff_core.routing.control import RateController
from backoff_core.routing.routers import DecisionFunction
from backoff_core.types import (
    CatchUp,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    Timings,
    TokenEvent,
    TokenLogprobs,
    Verification,
)


class Waiting(NamedTuple):
    """A step routed to a larger level whose catch-up waits to be batched with others'
    (engine.py, `catch_up_wait_ms`): what M_S's step decided, kept for the commit."""

    level: int
    token: int  # M_S's draw: the step's token if the catch-up fails (degraded)
    score: float | None  # the router's score (the rate controller reads it at commit)
    since: float  # when the step that routed it began (the engine's clock, s)


@dataclass
class PenaltyCounts:
    """One penalized request's counts of presence, frequency and repetition penalties, on the
    logits' device (penalties.py keeps them)."""

    counts: torch.Tensor  # [V] float32: each id's count among tokens[prompt_len:upto]
    prompt: torch.Tensor  # [V] bool: the prompt's ids (repetition reads them)
    upto: int  # the position the counts are as of
    # ids counted but truncated since (a rollback, Live.truncate): subtracted at the next batch
    dropped: list[int] = field(default_factory=list)


@dataclass
class Stats:
    """How a request ran, as its result reports it (GenerationResult's timings and records)."""

    started: float = field(default_factory=time.perf_counter)  # admission (perf_counter, s)
    prefill_s: float = 0.0
    first_token_s: float | None = None  # from `started` to the first token streamed
    small_times: list[float] = field(default_factory=list)  # s, per M_S step
    router_times: list[float] = field(default_factory=list)  # s, per routed step's decision
    cached_prompt: int = 0  # prompt positions M_S loaded from its prefix cache (not prefilled)
    catch_ups: list[CatchUp] = field(default_factory=list)
    kl_at_catch_up: list[float] = field(default_factory=list)
    rollbacks: int = 0  # tokens dropped by verification


@dataclass
class PromptScores:
    """A request's prompt logprobs (engine/prompt.py), when it asks for them: per prompt token."""

    logprobs: list[TokenLogprobs | None]  # the first token's None (nothing predicts it)
    sources: list[int | None]  # the level that scored each token
    text: str  # the decoded prompt, which the logprobs' text offsets index


@dataclass
class Live:
    request: GenerationRequest
    request_id: str
    router: DecisionFunction
    # N-1 ascending finite floats (Python floats: float64; float32 would overflow a huge one);
    # host data, so routing decisions never wait for the device
    thresholds: tuple[float, ...]
    seed: int  # the request's draws are a pure function of (seed, position): sampling.py
    num_levels: int
    controller: RateController | None = None
    tokens: list[int] = field(default_factory=list)  # prompt + committed
    sources: list[int] = field(default_factory=list)  # one per generated token
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per generated token, if asked
    fed: list[int] = field(default_factory=list)  # per level: positions in its cache
    opened: set[int] = field(default_factory=set)  # levels holding a session for this request
    # chunked prefill's feed plan (chunked.py): per level, the positions its cache must hold
    # (fed[level] catching up, a chunk per step) before this request steps again; empty: it steps
    plan: list[int] = field(default_factory=list)
    # logits [V] that predicted position j, of the model level that last ran there
    last_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # level -> [V]
    source_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [V]
    small_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [V]
    stats: Stats = field(default_factory=Stats)  # timings, catch-ups, rollbacks: the result's records
    finished: FinishReason | None = None
    finish_after_verify: FinishReason | None = None  # unverified drafts to check first
    text: str = ""  # text streamed so far (stable prefix)
    cut_at: int | None = None  # stop string: text length to keep
    stop_from: int = 0  # min_tokens: the text length of its first min_tokens; a stop string must end past it
    degraded: str = ""  # why the larger models were given up ("": they were not); M_S only since
    # the error that ends this request alone (finish() raises it): LargeUnavailable with
    # on_large_failure = "fail", or whatever handling this one request raised (isolation.py)
    failure: Exception | None = None
    prompt_scores: PromptScores | None = None  # when the request asks for prompt logprobs
    # a prompt being scored (prompt.ScoringProgress), over several steps where chunked; None otherwise
    scoring: object | None = None
    prompt_len: int = field(init=False)  # len(request.prompt_ids), read several times a step
    verifies: bool = field(init=False)  # request.routing.verification is not NONE (read every step)
    penalized: bool = field(init=False)  # request.sampling has penalties (read at every draw)
    fixed_sampling: SamplingParams | None = field(init=False)  # sampling_at's answer at every position, or None
    decode_state: tuple | None = None  # Detokenizer's incremental text of the generated ids (incremental.py)
    waiting: Waiting | None = None  # its step waits for a batched catch-up; it does not step meanwhile
    # min_tokens: request.sampling with EOS and the stop ids banned, for the positions before
    # prompt_len + min_tokens (admission.checked; None: no min_tokens)
    early_sampling: SamplingParams | None = None
    # presence, frequency and repetition penalties' counts on the device (penalties.py; None:
    # not penalized, or no draw yet)
    penalty: PenaltyCounts | None = None

    def __post_init__(self) -> None:
        self.prompt_len = len(self.request.prompt_ids)
        self.verifies = self.request.routing.verification != Verification.NONE
        self.penalized = self.request.sampling.penalized
        s = self.request.sampling  # the params of every position, unless min_tokens varies them
        self.fixed_sampling = s if self.early_sampling is None else None

    @property
    def done(self) -> bool:
        return self.finished is not None or self.failure is not None

    @property
    def backlog(self) -> dict[int, int]:
        """level -> its target in the plan, for the levels whose cache is short of it."""
        return {level: target for level, target in enumerate(self.plan) if self.fed[level] < target}

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def sampling_at(self, position: int) -> SamplingParams:
        """The params a token at `position` is drawn (or verified) with: min_tokens bans EOS and
        the stop ids before prompt_len + min_tokens. Penalties are not in them: they read the
        tokens before `position` on the device (penalties.py)."""
        if self.fixed_sampling is not None:  # the common case: one attribute read a row
            return self.fixed_sampling
        s = self.request.sampling
        return self.early_sampling if position < self.prompt_len + s.min_tokens else s

    def drafts(self) -> int:
        """Tokens of smaller models committed since the largest model last read the sequence."""
        start = max(self.fed[-1], self.prompt_len) - self.prompt_len
        return sum(1 for s in self.sources[start:] if s < self.num_levels - 1)

    def truncate(self, position: int) -> int:
        """Drop committed tokens from `position` on; returns how many were dropped."""
        dropped = len(self.tokens) - position
        if self.penalty is not None and self.penalty.upto > position:  # counted, now gone
            self.penalty.dropped += self.tokens[position : self.penalty.upto]
            self.penalty.upto = position
        del self.tokens[position:]
        self.decode_state = None  # its text covered the dropped ids
        del self.sources[position - self.prompt_len :]
        del self.logprobs[position - self.prompt_len :]
        for table in (self.source_logits, self.small_logits):
            for j in [j for j in table if j >= position]:
                del table[j]
        return dropped

    def schedule_drafts(self, rejected: bool) -> None:
        """HF assisted generation's heuristic: more drafts while they hold, fewer once they fail."""
        routing = self.request.routing
        if routing.router == "draft" and routing.draft_schedule == "heuristic":
            self.thresholds = tuple(min(64.0, max(1.0, t - 1 if rejected else t + 2)) for t in self.thresholds)

    def prune(self) -> None:
        """Forget logits no catch-up can still verify (positions every level has read).
        The common case (no verification, no KL record) has none: append() skips the call."""
        horizon = min(self.fed[1:], default=len(self.tokens))
        for table in (self.source_logits, self.small_logits):
            for j in [j for j in table if j < horizon]:
                del table[j]

    def result(self, text: str) -> GenerationResult:
        stats, scores = self.stats, self.prompt_scores
        total = time.perf_counter() - stats.started
        return GenerationResult(
            request_id=self.request_id,
            text=text,
            token_ids=tuple(self.generated),
            sources=tuple(self.sources),
            num_levels=self.num_levels,
            finish_reason=self.finished or FinishReason.LENGTH,
            prompt_tokens=self.prompt_len,
            cached_prompt_tokens=stats.cached_prompt,
            catch_ups=tuple(stats.catch_ups),
            rollbacks=stats.rollbacks,
            timings=Timings(
                prefill=stats.prefill_s,
                small_steps=tuple(stats.small_times),
                router_steps=tuple(stats.router_times),
                first_token=stats.first_token_s if stats.first_token_s is not None else total,
                total=total,
            ),
            kl_at_catch_up=tuple(stats.kl_at_catch_up),
            thresholds=tuple(self.thresholds),
            degraded=bool(self.degraded),
            degraded_reason=self.degraded,
            logprobs=tuple(self.logprobs) if self.request.sampling.logprobs is not None else None,
            prompt_logprobs=tuple(scores.logprobs) if scores is not None else None,
            prompt_sources=tuple(scores.sources) if scores is not None else None,
            prompt_text=scores.text if scores is not None else None,
        )


class Detokenizer:
    """Incremental text: emits only text that later tokens cannot change (no half UTF-8)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._held: tuple[Live, int, str] | None = None  # decoded(hold=True): (live, tokens, text)
        # A fast tokenizer's decode is its Rust backend's plus an optional clean-up; calling
        # the backend directly skips transformers' per-id Python checks (most of the cost of
        # decoding the whole text at every step).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.incremental = None  # incremental.py: the text of the new ids only, where exact
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self.decode = functools.partial(backend.decode, skip_special_tokens=True)
            self.incremental = incremental.for_backend(backend, self.decode)
        else:
            self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)

    def forget(self) -> None:
        self._held = None

    def decoded(self, live: Live, hold: bool = False) -> str:
        """decode(live.generated). hold: keep it for the next call about live (the stop check's
        text, which the event reads next), valid while live holds the same tokens."""
        held, self._held = self._held, None
        if held is not None and held[0] is live and held[1] == len(live.tokens):
            return held[2]
        if self.incremental is None:
            text = self.decode(live.tokens[live.prompt_len :])
        else:
            state = live.decode_state
            if state is not None and state[0] > len(live.tokens) - live.prompt_len:
                state = None  # fewer ids than it covers (truncate drops it anyway)
            text, live.decode_state = self.incremental.text(live.tokens, live.prompt_len, state)
        if hold:
            self._held = (live, len(live.tokens), text)
        return text

    def full_text(self, live: Live) -> str:
        text = self.decoded(live)
        return text if live.cut_at is None else text[: live.cut_at]

    def event(self, live: Live, source: int, retracted: int) -> TokenEvent:
        text = self.decoded(live)
        if live.cut_at is not None:  # full_text, inline: this runs once per request and step
            text = text[: live.cut_at]
        if not live.finished:
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character: wait for more
        old = live.text
        common = len(old) if text.startswith(old) else _common_prefix(old, text)
        live.text = text
        return TokenEvent(
            live.tokens[-1], source, text[common:], len(live.tokens) - live.prompt_len - 1, retracted, old[common:]
        )


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
