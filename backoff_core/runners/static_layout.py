"""How one StaticRunner forward lays its items out as a bucketed batch (static.py).

Items are (positions held, slot, new ids). Rows of the batch are powers of two: when the
extending slots are dense (2 * items >= nb, nb = the power of two above the highest slot)
batch row = slot and storage[:nb] is read as a view, idle rows riding along as padding;
otherwise item i is row i and its slot's rows are gathered. Where the runner measured that
a gathered batch of nb / 2 rows beats the view (catch-ups of many tokens a row on a large
model: the idle rows' padding is compute), exactly nb / 2 items gather too. New tokens are right-padded to
k (a k bucket); padding writes to the scratch column that no real query sees.

Built with numpy over the whole batch (a few array ops, whatever the item count), not a
Python list per row: at 64 rows the per-row version cost more than a captured GPU step.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backoff_core.runners.graph_plan import GraphKey
from backoff_core.runners.static_kv import bucket, next_power_of_two


@dataclass(frozen=True)
class Plan:
    """One forward's layout (host tensors)."""

    key: GraphKey
    rows: np.ndarray  # [n] int64: the batch row of each item
    input_ids: torch.Tensor  # [B, K]
    positions: torch.Tensor  # [B, K]; padding at the scratch column
    slots: torch.Tensor  # [B]
    last_col: torch.Tensor  # [B]
    in_order: bool  # whether item i is batch row i for every item (its outputs need no gather)


def lay_out(
    lengths: Sequence[int],
    slots: Sequence[int],
    new_ids: Sequence[Sequence[int]],
    *,
    ks: tuple[int, ...],
    length_buckets: tuple[int, ...],
    num_slots: int,
    scratch: int,
    layer: int | None,
    last_only: bool,
    gather_over: Collection[tuple[int, int]] = (),
) -> Plan:
    """lengths, slots: per item, the positions its session holds and its storage slot;
    new_ids: per item, at least one id. ks: the k buckets allowed (a longer row: k_max
    itself, an eager forward). gather_over: (k, dense rows) at which the gathered batch of
    half the rows is the faster one (measured at load: StaticRunner._measure_layouts), so
    n <= rows / 2 items gather there even when the dense rule holds."""
    n = len(new_ids)
    k_max = max(map(len, new_ids))
    held = np.fromiter(lengths, np.int64, n)
    slot = np.fromiter(slots, np.int64, n)
    new = np.fromiter(itertools.chain.from_iterable(new_ids), np.int64)  # every new id, row-major
    counts = np.fromiter(map(len, new_ids), np.int64, n) if k_max > 1 else None  # [n]
    k = bucket(k_max, ks or (k_max,))
    length = bucket(int(held.max()) + 1 if counts is None else int((held + counts).max()), length_buckets)
    top = next_power_of_two(int(slot.max()) + 1)
    dense = top <= num_slots and 2 * n >= top and not (2 * n <= top and (k, top) in gather_over)
    rows = top if dense else next_power_of_two(n)
    at = slot if dense else np.arange(n)  # [n] each item's batch row
    input_ids = np.zeros((rows, k), np.int64)
    positions = np.full((rows, k), scratch, np.int64)
    columns = np.arange(k)
    last_col = np.zeros(rows, np.int64)
    if counts is None:  # one new id each (an M_S step): no mask, every last column 0
        input_ids[at, 0] = new
        positions[at, 0] = held
    else:
        real = columns[None, :] < counts[:, None]  # [n, k]; row-major, as the ids are chained
        ids = np.zeros((n, k), np.int64)
        ids[real] = new
        input_ids[at] = ids
        positions[at] = np.where(real, held[:, None] + columns[None, :], scratch)
        last_col[at] = counts - 1
    # gather: padding rows read slot 0 and write only its scratch column
    batch_slots = np.arange(rows) if dense else np.zeros(rows, np.int64)
    batch_slots[at] = slot
    # one new token: its logits are the last ones either way
    key = GraphKey(dense, rows, k, length, last_only or k == 1, layer)
    return Plan(
        key,
        at,
        torch.from_numpy(input_ids),
        torch.from_numpy(positions),
        torch.from_numpy(batch_slots),
        torch.from_numpy(last_col),
        in_order=not dense or bool((slot == np.arange(n)).all()),
    )
