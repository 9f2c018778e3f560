"""Scored rows: what an extend returns instead of full logits where only a few numbers are
wanted (prompt logprobs, engine/prompt.py).

Row j of an extend's output is the next-token distribution after its j-th new id. A
`Scoring` names some rows and, per row, a target id: the runner answers with the target's
log-probability and the top-n alternatives of each such row (`Scored`), computed where the
logits are. Over a remote model that is 4·(1 + 2n) bytes a row instead of 4·V (V = 49152:
~200 KB a row), and a runner that can keep only some positions' logits runs its LM head on
those rows alone.

The values are those of logprobs.token_logprobs: log_softmax at temperature 1 of the raw
logits, a NaN logit as -inf, -inf (and underflow) as LOGPROB_FLOOR so every value is finite.

An oracle router's score at a row is KL(M_L || M_S), which reads both full distributions:
one of them has to cross the wire. A `Scoring` with `against` (M_S's logits at its rows)
sends M_S's to M_L, which answers the KL a row with the target and top-n (`Scored.kl`): the
same bytes as M_L's logits coming back, but the reply is a few numbers a row and the
router's score is computed where the larger model's logits are (docs/routers.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backoff_core.sampling import kl_divergence

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class Scoring:
    """The rows of one session's extend to score, each with the id whose log-probability is wanted."""

    rows: tuple[int, ...]  # indices into the extend's new ids (each < k), ascending
    targets: tuple[int, ...]  # one id per row
    top_n: int = 0  # alternatives per row, most likely first
    # [m, V] float32: M_S's logits at the rows (an oracle's prompt scoring): the runner answers
    # KL(its distribution || M_S's) a row too (Scored.kl); None: no KL
    against: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.targets):
            raise ValueError(f"a scoring needs one target per row, got {len(self.rows)} rows, {len(self.targets)}")
        if list(self.rows) != sorted(set(self.rows)) or (self.rows and self.rows[0] < 0):
            raise ValueError("scored rows must be distinct, ascending and >= 0")
        if self.top_n < 0:
            raise ValueError(f"top_n must be >= 0, got {self.top_n}")

    def check(self, new_ids: int, vocab_size: int) -> None:
        """Raise ValueError unless every row lies in an extend of new_ids and every target in the vocabulary."""
        if self.rows and self.rows[-1] >= new_ids:
            raise ValueError(f"scored row {self.rows[-1]} outside an extend of {new_ids} ids")
        if any(not 0 <= t < vocab_size for t in self.targets):
            raise ValueError(f"scored targets must be in [0, {vocab_size})")
        if self.against is not None and tuple(self.against.shape) != (len(self.rows), vocab_size):
            raise ValueError(
                f"scoring against M_S needs [{len(self.rows)}, {vocab_size}] logits, got {tuple(self.against.shape)}"
            )


def per_item(name: str, items: list, scoring, vocab_size: int) -> list[Scoring | None]:
    """An extend's scoring argument checked against its items: one Scoring (or None) per
    item, each row inside its item's new ids and each target in the vocabulary."""
    scoring = list(scoring) if scoring is not None else [None] * len(items)
    if len(scoring) != len(items):
        raise ValueError(f"{name}: one scoring (or None) per item")
    for (_, ids), sc in zip(items, scoring):
        if sc is not None:
            sc.check(len(ids), vocab_size)
    return scoring


@dataclass(frozen=True)
class Scored:
    """One session's scored rows (m of them), on the host."""

    target: torch.Tensor  # [m] float32: log-probability of each row's target
    top_ids: torch.Tensor  # [m, n] int64: the n most likely ids of each row, most likely first
    top: torch.Tensor  # [m, n] float32: their log-probabilities
    kl: torch.Tensor | None = None  # [m] float32: KL(this model || M_S) a row (Scoring.against)

    @classmethod
    def cat(cls, parts: list[Scored]) -> Scored:
        """Scored rows of consecutive pieces, as one."""
        kl = None if any(p.kl is None for p in parts) else torch.cat([p.kl for p in parts])
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("target", "top_ids", "top")), kl)

    def take(self, index: list[int]) -> Scored:
        """Rows `index` of these (positions in this Scored, not prompt rows)."""
        kl = None if self.kl is None else self.kl[index]
        return Scored(self.target[index], self.top_ids[index], self.top[index], kl)


def score_rows(
    logits: torch.Tensor, targets: tuple[int, ...], top_n: int, against: torch.Tensor | None = None
) -> Scored:
    """logits: [m, V] raw next-token logits, one row per target -> Scored (one host copy);
    against: [m, V] M_S's logits at those rows, whose KL(logits || against) a row is Scored.kl
    (the oracle routers' score, sampling.kl_divergence, as the step loop computes it)."""
    logp = torch.log_softmax(torch.nan_to_num(logits.float(), nan=float("-inf")), dim=-1)  # [m, V]
    logp = logp.clamp_min(LOGPROB_FLOOR)
    index = torch.tensor(targets, dtype=torch.long, device=logp.device)[:, None]  # [m, 1]
    target = logp.gather(-1, index)[:, 0]  # [m]
    top = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)  # sorted, descending
    kl = None if against is None else kl_divergence(logits, against.to(logits.device)).cpu()
    return Scored(target.cpu(), top.indices.cpu(), top.values.cpu(), kl)


def empty_scored(top_n: int) -> Scored:
    return Scored(torch.zeros(0), torch.zeros(0, top_n, dtype=torch.long), torch.zeros(0, top_n))
