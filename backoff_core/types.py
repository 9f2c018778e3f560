"""Records that the stages of backoff decoding hand to each other.

Every transport (CLI, HTTP, gRPC) converts its own schema into these frozen dataclasses;
nothing inside `backoff_core` passes dicts. Level 0 is the smallest model, N-1 the largest
("source" of a token = the level whose distribution it was sampled from).

Here: what a request asks (GenerationRequest: its SamplingParams and RoutingParams) and the
KV storage of a model (KVSpec, PrefixCacheSpec). What a request produces (TokenEvent, its
logprobs, GenerationResult) is results.py's, imported from here too: one module of records
for every stage and transport.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from backoff_core.results import CatchUp as CatchUp
from backoff_core.results import FinishReason as FinishReason
from backoff_core.results import GenerationResult as GenerationResult
from backoff_core.results import Logprob as Logprob
from backoff_core.results import Timings as Timings
from backoff_core.results import TokenEvent as TokenEvent
from backoff_core.results import TokenLogprobs as TokenLogprobs


class Verification(str, enum.Enum):
    """What a catch-up does with the M_L logits it gets for free at every pending position."""

    NONE = "none"  # pure backoff: nothing is checked, committed tokens stay
    KL = "kl"  # BiLD-style: roll back to the first position with KL(M_L||M_src) > tolerance
    EXACT = "exact"  # rejection sampling (lossless, as in speculative decoding)


def level_names(num_levels: int) -> list[str]:
    """The models of a chain by level, as code, metrics and the wire name them: M_S is
    "small", M_L "large", any model between them "medium1", "medium2", ..."""
    return ["small", *[f"medium{i}" for i in range(1, num_levels - 1)], "large"]


# Most alternatives a request may ask for per token (OpenAI's top_logprobs: 0..20)
MAX_TOP_LOGPROBS = 20

# A temperature below this samples greedily: logits / T would overflow float32 long before T
# reaches 0, and at 1e-4 any logit gap over ~0.01 already gives the argmax all the mass.
TEMPERATURE_FLOOR = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from a distribution. temperature == 0 (or under TEMPERATURE_FLOOR) means greedy."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0  # after temperature, drop tokens under min_p x the likeliest's probability (vLLM's)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # token ids that end the request as EOS does (kept in the output), ignore_eos or not
    stop_token_ids: tuple[int, ...] = ()
    # (token id, bias) pairs, ascending ids: added to every level's logits before temperature,
    # top-k and top-p (OpenAI's logit_bias: the edge takes [-100, 100]; -100 bans a token, +100
    # all but forces it; -inf, which min_tokens uses, a true ban; penalties add larger values
    # here); the routers' scores and logprobs read the raw logits
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's allowed_token_ids, ascending: only these ids may be drawn from any level's
    # distribution (every other id -inf after the bias, sampling.py); (): every id
    allowed_token_ids: tuple[int, ...] = ()
    # tokens generated before EOS, a stop token id or a stop string may end the request (vLLM's
    # min_tokens): until then EOS and the stop ids are banned from every level's distribution
    min_tokens: int = 0
    # penalties on tokens already in the sequence, as vLLM applies them: repetition (HF's: a
    # seen token's logit / p where positive, * p where not; prompt and generated tokens) first,
    # then presence and frequency (OpenAI's: -presence once a generated token has appeared,
    # -frequency per time), then logit_bias. Their counts live on the logits' device, one row
    # a request, updated by the tokens committed or dropped since its last draw
    # (engine/penalties.py), so a draw's host work does not grow with the sequence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # log-probabilities of each committed token under its source model's raw distribution
    # (logprobs.py), with this many top alternatives (0..MAX_TOP_LOGPROBS); None: none (free)
    logprobs: int | None = None
    # log-probability of every PROMPT token under the request's routed teacher-forced
    # distribution (engine/prompt.py), with this many top alternatives; None: none (free)
    prompt_logprobs: int | None = None
    # the first prompt position scored (>= 1): the positions before it get no entry (None) and
    # cost a plain prefill, not the LM heads over every row (lm-eval's loglikelihood wants the
    # continuation alone, after a long context)
    prompt_logprobs_from: int = 1

    def __post_init__(self) -> None:
        if self.prompt_logprobs_from < 1:
            raise ValueError(f"prompt_logprobs_from must be >= 1, got {self.prompt_logprobs_from}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs (top alternatives) must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if self.max_tokens < 1 and not (self.max_tokens == 0 and self.prompt_logprobs is not None):
            raise ValueError(
                f"max_tokens must be >= 1 (0 only with prompt_logprobs: score the prompt, generate nothing), "
                f"got {self.max_tokens}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(math.isnan(b) or b == math.inf for _, b in self.logit_bias):  # the edge keeps users' to +-100
            raise ValueError("logit_bias values must be numbers under +inf")
        if not (math.isfinite(self.presence_penalty) and math.isfinite(self.frequency_penalty)):
            raise ValueError("presence_penalty and frequency_penalty must be finite")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        ids = [t for t, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(t < 0 for t in ids):
            raise ValueError("logit_bias token ids must be distinct, ascending and >= 0")
        allowed = list(self.allowed_token_ids)
        if allowed != sorted(set(allowed)) or any(t < 0 for t in allowed):
            raise ValueError("allowed_token_ids must be distinct, ascending and >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs (top alternatives) must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    def banning(self, ids: frozenset[int]) -> SamplingParams:
        """These params with `ids` banned (a bias of -inf over any of theirs): min_tokens' early
        positions."""
        bias = dict(self.logit_bias) | dict.fromkeys(ids, -math.inf)
        return dataclasses.replace(self, logit_bias=tuple(sorted(bias.items())))


def parse_thresholds(value: str | float | Sequence[float]) -> tuple[float, ...]:
    """A request's thresholds as every stage passes them, from any form they arrive in: one
    number (a two-model chain), a sequence with one per boundary between models, or the
    command line's "2,4". The one check of their values: each a number (not NaN), at least
    one, ascending (a step's level is the number it reaches). +-inf stays (admission clamps it
    to float64's finite ends); the wire keeps its own to +-1e38 (float32). How many a chain
    needs, and the range a router's score has, are admission's (engine/admission.py)."""
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
        try:
            thresholds = tuple(float(part) for part in parts)
        except ValueError:
            raise ValueError(f"thresholds must be numbers separated by commas, got {value!r}") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        thresholds = (float(value),)
    elif isinstance(value, Sequence) and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in value):
        thresholds = tuple(float(t) for t in value)
    else:
        raise ValueError(f"thresholds must be a number or a list of numbers, got {value!r}")
    if not thresholds:
        raise ValueError("give at least one threshold (none at all: the router's default)")
    if any(math.isnan(t) for t in thresholds):
        raise ValueError("thresholds must not be NaN")
    if list(thresholds) != sorted(thresholds):
        raise ValueError(f"thresholds must be ascending, got {list(thresholds)}")
    return thresholds


@dataclass(frozen=True)
class RoutingParams:
    """Which decision function picks each step's source, and how its score maps to a level.

    thresholds: one per boundary between levels (N-1 of them, ascending); a step goes to
    level = number of thresholds its score reaches. None: the router's own default. Any form
    parse_thresholds takes is stored as its tuple.
    rate: for `random`, the backoff rate (share of steps kept on the smallest model).
    target_backoff: ask for a backoff rate instead of a threshold; a controller moves the
    threshold during generation so the achieved rate tracks it.
    """

    router: str = "always-small"
    thresholds: tuple[float, ...] | None = None
    rate: float | None = None
    target_backoff: float | None = None
    draft_tokens: int = 4  # for `draft` (the speculative mode's router): drafts per verification
    # "heuristic" (HF assisted generation's schedule): +2 drafts after a fully accepted
    # verification, -1 (down to 1) after a rejection; "constant": always draft_tokens
    draft_schedule: str = "heuristic"
    verification: Verification = Verification.NONE
    tolerance: float = math.inf  # for Verification.KL
    eager_prefill: bool = False  # prefill M_L's prompt at admission rather than at its first call
    prefix_cache: bool = True  # start from the longest cached prompt prefix, and cache this prompt's blocks
    # a larger model that cannot answer in time (backends.LargeUnavailable): "degrade" = the
    # request goes on with the small model alone (flagged `degraded`), "fail" = it ends with the error
    on_large_failure: str = "degrade"

    def __post_init__(self) -> None:
        if self.thresholds is not None:  # canonical: a tuple of floats, checked (parse_thresholds)
            object.__setattr__(self, "thresholds", parse_thresholds(self.thresholds))
        for name, value in (("rate", self.rate), ("target_backoff", self.target_backoff)):
            if value is not None and not (0.0 <= value <= 1.0):
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {self.draft_tokens}")
        if self.draft_schedule not in ("heuristic", "constant"):
            raise ValueError(f"draft_schedule must be 'heuristic' or 'constant', got {self.draft_schedule!r}")
        if self.on_large_failure not in ("degrade", "fail"):
            raise ValueError(f"on_large_failure must be 'degrade' or 'fail', got {self.on_large_failure!r}")
        if math.isnan(self.tolerance) or self.tolerance < 0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance}")


RAGGED_MODES = ("auto", "on", "off")  # KVSpec.ragged
COMPILE_MODES = ("auto", "on", "off")  # KVSpec.compile


@dataclass(frozen=True)
class KVSpec:
    """The KV budget of one model: `budget_tokens` positions it may hold across sessions.
    static: preallocated storage (static_runner.py) cut into slots of `max_len` positions,
    a session owning one slot while it lives; cuda_graphs: replay captured CUDA graphs for
    one-token steps and short catch-ups (GPU). Not static: per-session caches (runner.py)
    that count the positions they hold and evict idle sessions to stay within the budget.
    ragged: static KV on CUDA, the larger model's catch-ups as ragged forwards, their tokens
    unpadded (static_ragged.py): "auto" (with CUDA graphs: each catch-up ragged where its ragged
    replays were timed faster than its padded layout's), "on" (wherever they apply), "off".
    compile: static KV, every decoder layer one inductor-compiled function (fewer, larger
    kernels: runners/static_compiled.py): "auto" (where CUDA graphs capture it), "on", "off"."""

    budget_tokens: int
    max_len: int = 2048
    cuda_graphs: bool = True
    static: bool = True
    ragged: str = "auto"
    compile: str = "auto"

    def __post_init__(self) -> None:
        if self.ragged not in RAGGED_MODES:
            raise ValueError(f"ragged must be one of {', '.join(RAGGED_MODES)}, got {self.ragged!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.max_len < 2:
            raise ValueError(f"the KV slot length (max_len) must be >= 2, got {self.max_len}")
        if self.budget_tokens < 1:
            raise ValueError(f"a KV budget must be >= 1 token, got {self.budget_tokens}")
        if self.static and self.budget_tokens < self.max_len:
            raise ValueError(f"a KV budget of {self.budget_tokens} tokens holds no slot of {self.max_len} positions")

    @property
    def slots(self) -> int:
        return self.budget_tokens // self.max_len


@dataclass(frozen=True)
class PrefixCacheSpec:
    """The prefix cache of one model (runners/prefix_cache.py): the KV of prompt blocks of
    `block_tokens` tokens seen before, at most `budget_tokens` positions, LRU. 0: off."""

    budget_tokens: int = 8192
    block_tokens: int = 32

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"a prefix cache block must hold >= 1 token, got {self.block_tokens}")
        if self.budget_tokens < 0:
            raise ValueError(f"a prefix cache budget must be >= 0 tokens (0: off), got {self.budget_tokens}")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    routing: RoutingParams = field(default_factory=RoutingParams)
    request_id: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt must contain at least one token")
