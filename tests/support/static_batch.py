"""A hand-built `Batch` of the static forward (test_static_forward.py, test_static_compiled.py)."""

from __future__ import annotations

import torch

from backoff_core.runners.static_forward import Batch

MAX_LEN = 64  # the slots' length the tests' StaticKV storages use


def batch(
    rows: list[list[int]], starts: list[int], slots: list[int], length: int, last_only=False, hidden_layer=None
) -> Batch:
    """Rows right-padded to the longest; padding goes to the scratch column (MAX_LEN - 1)."""
    k = max(map(len, rows))
    ids = torch.tensor([r + [0] * (k - len(r)) for r in rows])  # [B, K]
    pos = torch.tensor([[s + j if j < len(r) else MAX_LEN - 1 for j in range(k)] for r, s in zip(rows, starts)])
    return Batch(
        input_ids=ids,
        positions=pos,
        slots=torch.tensor(slots),
        last_col=torch.tensor([len(r) - 1 for r in rows]),
        length=length,
        dense=slots == list(range(len(slots))),
        last_only=last_only,
        hidden_layer=hidden_layer,
    )
