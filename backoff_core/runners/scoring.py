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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class Scoring:
    """The rows of one session's extend to score, each with the id whose log-probability is wanted."""

    rows: tuple[int, ...]  # indices into the extend's new ids (each < k), ascending
    targets: tuple[int, ...]  # one id per row
    top_n: int = 0  # alternatives per row, most likely first

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


def score_rows(logits: torch.Tensor, targets: tuple[int, ...], top_n: int) -> Scored:
    """logits: [m, V] raw next-token logits, one row per target -> Scored (one host copy)."""
    logp = torch.log_softmax(torch.nan_to_num(logits.float(), nan=float("-inf")), dim=-1)  # [m, V]
    logp = logp.clamp_min(LOGPROB_FLOOR)
    index = torch.tensor(targets, dtype=torch.long, device=logp.device)[:, None]  # [m, 1]
    target = logp.gather(-1, index)[:, 0]  # [m]
    top = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)  # sorted, descending
    return Scored(target.cpu(), top.indices.cpu(), top.values.cpu())


def empty_scored(top_n: int) -> Scored:
    return Scored(torch.zeros(0), torch.zeros(0, top_n, dtype=torch.long), torch.zeros(0, top_n))
