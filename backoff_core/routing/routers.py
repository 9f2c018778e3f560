"""Decision functions: what decides which model's distribution each step samples from.

A decision function gives every sequence of the batch a score; the step goes to
level = number of thresholds the score reaches (thresholds ascend; one per boundary between
models). Higher score = harder step = bigger model. The threshold is the live knob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, ClassVar

import numpy as np
import torch

from backoff_core.sampling import entropy, kl_divergence


@dataclass(frozen=True)
class StepContext:
    """What is known at one step, for B sequences."""

    small_logits: torch.Tensor  # [B, V] M_S's next-token logits
    hidden: torch.Tensor | None  # [B, d] M_S hidden state at the router's layer
    large_logits: torch.Tensor | None  # [B, V] largest model's logits (oracles only)
    drafts: torch.Tensor  # [B] tokens committed since the largest model last ran
    uniforms: torch.Tensor  # [B] one U(0,1) per sequence from its own seeded generator
    # [B] KL(M_L || M_S), computed where M_L's logits are (an oracle's prompt scoring, whose
    # M_L rows never cross the wire: engine/prompt.py); None: from large_logits
    kl: torch.Tensor | None = None
    # every tensor is on the logits' device; scores() returns [B] there too, and the step
    # loop reads them back with the step's tokens in one copy (engine/host.py)

    def row(self, i: int) -> StepContext:
        """Row i, as a batch of one."""
        return StepContext(
            **{f.name: None if (v := getattr(self, f.name)) is None else v[i : i + 1] for f in fields(self)}
        )


class DecisionFunction:
    """Base class. Subclasses set `name` and implement `scores`."""

    name: ClassVar[str]
    needs_large_logits: ClassVar[bool] = False  # oracle: M_L must catch up every step
    # thresholds that mean something for this score (outside it every step goes one way)
    threshold_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)
    hidden_layer: int | None = None  # which M_S hidden state to hand over, if any
    # what the step loop must compute for this router (each costs host work per request):
    reads_drafts: ClassVar[bool] = False  # StepContext.drafts
    # StepContext.uniforms (zeros when False). A subclass that overrides `scores` reads
    # them unless it says otherwise (__init_subclass__), so a new score is never starved.
    reads_uniforms: ClassVar[bool] = True
    forces_levels: ClassVar[bool] = False  # levels_before_small_step is overridden
    # decides each prompt position from M_S's state there (prompt logprobs, engine/prompt.py)
    scores_prompts: ClassVar[bool] = True
    # scores that are a function of host data alone (a constant, the seeded coin): the step
    # loop takes them from host_scores() and neither uploads nor reads them back. A subclass
    # that overrides `scores` alone scores on the device (__init_subclass__).
    scores_on_host: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "scores" in cls.__dict__ and "reads_uniforms" not in cls.__dict__:
            cls.reads_uniforms = True
        if "scores" in cls.__dict__ and "host_scores" not in cls.__dict__:
            cls.scores_on_host = False

    def default_thresholds(self, num_levels: int) -> tuple[float, ...]:
        return tuple(0.0 for _ in range(num_levels - 1))

    def scores(self, ctx: StepContext) -> torch.Tensor:  # -> [B]
        raise NotImplementedError

    def host_scores(self, n: int, uniforms: np.ndarray | None) -> list[float]:
        """With scores_on_host: the scores of n rows, the values scores() gives, from host
        data (uniforms: StepContext.uniforms as a float32 array, when reads_uniforms)."""
        raise NotImplementedError

    def levels_before_small_step(
        self, drafts: list[int], thresholds: list[tuple[float, ...]], num_levels: int
    ) -> list[int] | None:
        """Levels known without M_S's output (one per request, -1 = unknown), so M_S can skip
        the step. Host data only (drafts, each request's own N-1 thresholds): no tensor."""
        return None


class AlwaysSmall(DecisionFunction):
    name = "always-small"
    reads_uniforms = False
    scores_on_host = True

    def scores(self, ctx):
        return torch.full((ctx.small_logits.shape[0],), -math.inf, device=ctx.small_logits.device)

    def host_scores(self, n, uniforms):
        return [-math.inf] * n


class AlwaysLarge(DecisionFunction):
    name = "always-large"
    forces_levels = True
    reads_uniforms = False

    def scores(self, ctx):
        return torch.full((ctx.small_logits.shape[0],), math.inf, device=ctx.small_logits.device)

    def levels_before_small_step(self, drafts, thresholds, num_levels):
        return [num_levels - 1] * len(drafts)


class Oracle(DecisionFunction):
    """KL(M_L || M_S) >= T -> large. Needs M_L every step: an upper bound, not a speedup."""

    name = "oracle"
    needs_large_logits = True
    reads_uniforms = False

    def default_thresholds(self, num_levels):
        return tuple(0.5 * 2**i for i in range(num_levels - 1))

    def scores(self, ctx):
        return ctx.kl if ctx.kl is not None else kl_divergence(ctx.large_logits, ctx.small_logits)


class FlippedOracle(Oracle):
    """The ablation: sends the LOWEST-KL steps to the large model (score = -KL)."""

    name = "flipped-oracle"
    reads_uniforms = False

    def default_thresholds(self, num_levels):
        return tuple(-x for x in reversed(super().default_thresholds(num_levels)))

    def scores(self, ctx):
        return -super().scores(ctx)


class Entropy(DecisionFunction):
    """Entropy of M_S's distribution (nats): uncertain steps go large."""

    name = "entropy"
    reads_uniforms = False

    def default_thresholds(self, num_levels):
        return tuple(2.0 * (i + 1) for i in range(num_levels - 1))

    def scores(self, ctx):
        return entropy(ctx.small_logits)


class MaxProb(DecisionFunction):
    """1 - max_v p_S(v): BiLD's fallback rule."""

    name = "max-prob"
    reads_uniforms = False
    threshold_range = (0.0, 1.0)  # the score is a probability mass

    def default_thresholds(self, num_levels):
        return tuple(0.5 + 0.4 * i / max(1, num_levels - 1) for i in range(num_levels - 1))

    def scores(self, ctx):
        return 1.0 - torch.softmax(ctx.small_logits.float(), -1).amax(-1)


class Random(DecisionFunction):
    """Score ~ U(0, 1), so threshold T keeps a share T of steps small: T IS the backoff rate."""

    name = "random"
    threshold_range = (0.0, 1.0)  # a backoff rate
    scores_on_host = True

    def __init__(self, rate: float | None = None) -> None:
        self.rate = rate

    def default_thresholds(self, num_levels):
        if self.rate is not None and num_levels == 2:
            return (self.rate,)
        return tuple((i + 1) / num_levels for i in range(num_levels - 1))

    def scores(self, ctx):
        return ctx.uniforms

    def host_scores(self, n, uniforms):
        return uniforms.tolist()


class Draft(DecisionFunction):
    """Speculative decoding's schedule: K drafts from M_S, then the largest model verifies."""

    name = "draft"
    threshold_range = (1.0, math.inf)  # drafts before a verification
    reads_drafts = forces_levels = True
    scores_prompts = False  # its decision is a count of drafts: a prompt has none
    reads_uniforms = False

    def __init__(self, draft_tokens: int) -> None:
        self.draft_tokens = draft_tokens

    def default_thresholds(self, num_levels):
        return tuple(float(self.draft_tokens) for _ in range(num_levels - 1))

    def scores(self, ctx):
        return ctx.drafts.float()

    def levels_before_small_step(self, drafts, thresholds, num_levels):
        # the largest model verifies K drafts (K = the request's threshold, which the
        # draft schedule moves): M_S's step would be thrown away
        return [num_levels - 1 if d >= t[-1] else -1 for d, t in zip(drafts, thresholds)]


class Scripted(DecisionFunction):
    """Replays a fixed list of levels, one per step (tests and hand-written token scripts)."""

    name = "scripted"
    scores_prompts = False  # one scripted level per step, not per prompt position
    reads_uniforms = False

    def __init__(self, levels: list[int]) -> None:
        self.levels = list(levels)
        self.step = 0

    def default_thresholds(self, num_levels):
        return tuple(i + 0.5 for i in range(num_levels - 1))

    def scores(self, ctx):
        b = ctx.small_logits.shape[0]
        level = float(self.levels[min(self.step, len(self.levels) - 1)])
        out = torch.full((b,), level, device=ctx.small_logits.device)
        self.step += 1
        return out


class Classifier(DecisionFunction):
    """σ(MLP(hidden state of M_S at layer n)) (or the head's own score) >= T -> large."""

    name = "classifier"
    reads_uniforms = False

    def __init__(self, head: "torch.nn.Module") -> None:
        self.head = head.eval()
        self.hidden_layer = int(head.layer)

    def default_thresholds(self, num_levels):
        return self.head.default_thresholds(num_levels)

    @torch.inference_mode()
    def scores(self, ctx):
        if ctx.hidden is None:
            raise ValueError("classifier router needs M_S hidden states")
        return self.head.score(ctx.hidden, ctx.small_logits).float()


BUILTIN: dict[str, Callable[..., DecisionFunction]] = {
    cls.name: cls for cls in (AlwaysSmall, AlwaysLarge, Oracle, FlippedOracle, Entropy, MaxProb)
}
NAMES = tuple(sorted([*BUILTIN, "random", "draft", "classifier"]))


def build_router(
    name: str,
    *,
    rate: float | None = None,
    draft_tokens: int = 4,
    classifier_path: str | Path | None = None,
    hidden_size: int | None = None,
    script: list[int] | None = None,
) -> DecisionFunction:
    """A decision function by name (see NAMES). Raises ValueError naming the choices."""
    if name in BUILTIN:
        return BUILTIN[name]()
    if name == "random":
        return Random(rate)
    if name == "draft":
        return Draft(draft_tokens)
    if name == "scripted":
        return Scripted(script or [0])
    if name == "classifier":
        from backoff_core.routing.head import ClassifierHead

        if classifier_path is not None:
            return Classifier(ClassifierHead.load(classifier_path))
        if hidden_size is None:
            raise ValueError("classifier router needs a checkpoint path (or hidden_size for a random head)")
        return Classifier(ClassifierHead.random(hidden_size))
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(NAMES)}")
