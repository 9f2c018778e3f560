"""What an extend returns per session (every runner: dynamic.py, static.py, the remote proxy).

`Extension` is one item's logits (and hidden state, scored rows). A static runner's M_S step
returns its items' rows as one `LastRows` batch; each Extension then slices its row only
when read, and `last_rows` hands the step loop the batch itself, with no tensor op per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backoff_core.runners.scoring import Scored

__all__ = ["Extension", "LastRows", "last_rows"]


@dataclass(frozen=True, eq=False)
class LastRows:
    """An extend's outputs at each item's last new position, as one batch (row i: item i),
    so the step loop reads a batch's logits without a tensor op per item (static.py)."""

    logits: torch.Tensor  # [n, V] float32
    hidden: torch.Tensor | None  # [n, d]: only when every item had one new id


class Extension:
    """The result of extending one session by k tokens (read-only):
    logits [k, V] float32: the next-token logits after each new token ([1, V]: last_only);
    hidden [k, d] at the requested layer, or None; scored: the rows the extend's Scoring
    named (scoring.py), or None. `Extension.row(batch, i)` is item i of a LastRows, whose
    logits and hidden are sliced out only when read; `batch` is that LastRows (else None)."""

    __slots__ = ("_logits", "_hidden", "scored", "batch", "index")

    def __init__(self, logits: torch.Tensor, hidden: torch.Tensor | None, scored: Scored | None = None) -> None:
        self._logits, self._hidden, self.scored = logits, hidden, scored
        self.batch: LastRows | None = None
        self.index = 0

    @classmethod
    def row(cls, batch: LastRows, index: int) -> "Extension":
        ext = cls.__new__(cls)
        ext._logits = ext._hidden = ext.scored = None
        ext.batch, ext.index = batch, index
        return ext

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self.batch.logits[self.index : self.index + 1]  # [1, V]
        return self._logits

    @property
    def last(self) -> torch.Tensor:
        """[V]: the logits after the last new token (one view, not a slice of a slice)."""
        return self.batch.logits[self.index] if self._logits is None else self._logits[-1]

    @property
    def hidden(self) -> torch.Tensor | None:
        if self._hidden is None and self.batch is not None and self.batch.hidden is not None:
            self._hidden = self.batch.hidden[self.index : self.index + 1]  # [1, d]
        return self._hidden


def last_rows(exts: Sequence[Extension]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each extension's logits and hidden state after its last new token, stacked: [n, V],
    [n, d] (None unless every one has hidden). When they are the rows 0..n-1 of one
    LastRows, in order: that batch itself (no copy, no op per row)."""
    batch = exts[0].batch
    if (
        batch is not None
        and len(exts) == batch.logits.shape[0]
        and all(e.batch is batch and e.index == i for i, e in enumerate(exts))
    ):
        return batch.logits, batch.hidden
    hidden = [e.hidden for e in exts]
    stacked = torch.stack([h[-1] for h in hidden]) if all(h is not None for h in hidden) else None
    return torch.stack([e.last for e in exts]), stacked
