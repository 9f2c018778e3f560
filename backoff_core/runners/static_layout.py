"""How StaticRunner forwards lay their items out as bucketed batches (static.py).

Items are (positions held, slot, new ids). Rows of a batch are powers of two, and each row
carries k new tokens (a k bucket), right-padded; padding writes to the scratch column that no
real query sees. Two layouts:

- one row per item (`lay_out`): as a dense view, batch row = slot and storage[:nb] read in
  place (nb = the power of two above the highest slot), idle rows riding along as padding;
  or gathered, item i on row i reading its slot's rows. The M_S step (one new id each) and
  every eager forward take it, the view when the extending slots are dense (2 * items >= nb).
- blocks (`lay_out_blocks`): an item's new ids cut into blocks of k, each a gathered row of
  its own that reads its item's slot, the blocks of an item on consecutive rows. A later block
  sees the earlier ones' keys, which its layer wrote before its attention reads the slot. So
  one forward of blocks of 8 holds a catch-up whose rows carry 2 to 40 pending tokens, where
  one row per item pads every row to the longest (a 64-row view x 16 holds a third real tokens
  on the H100 run: catch_up_anatomy.json) or, past the largest k, needs one more forward
  (on an 8B model each costs its ~8 ms of weights) for the few long rows.

`choose` takes, for any other extend, of every layout whose graphs were captured the one whose
forwards' replays were measured fastest (StaticRunner.warmup times every graph): the cost of
padding against that of more rows or forwards is the device's, not a rule's. `blocks` builds
its plans, `read_out` hands each item its rows of the forwards' outputs.

Built with numpy over the whole batch (a few array ops, whatever the item count), not a
Python list per row: at 64 rows the per-row version cost more than a captured GPU step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backoff_core.runners.extension import Extension, LastRows
from backoff_core.runners.graph_plan import GraphKey
from backoff_core.runners.static_kv import bucket, next_power_of_two


@dataclass(frozen=True)
class Plan:
    """One forward's layout (host tensors)."""

    key: GraphKey
    rows: np.ndarray  # [n] int64: the batch row of each item (with blocks: its last block's)
    input_ids: torch.Tensor  # [B, K]
    positions: torch.Tensor  # [B, K]; padding at the scratch column
    slots: torch.Tensor  # [B]
    last_col: torch.Tensor  # [B]
    in_order: bool  # whether item i is batch row i for every item (its outputs need no gather)
    # blocks: [n] each item's first block row (its blocks are rows first[i] .. rows[i], every
    # one but the last full); None: one row per item
    first: np.ndarray | None = None


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
    dense: bool | None = None,
) -> Plan:
    """One row per item. lengths, slots: per item, the positions its session holds and its
    storage slot; new_ids: per item, at least one id. ks: the k buckets allowed (a longer
    row: k_max itself, an eager forward). dense: the view or gathered rows (None: the rule
    above; True needs the highest slot's power of two within num_slots)."""
    n = len(new_ids)
    k_max = max(map(len, new_ids))
    held = np.fromiter(lengths, np.int64, n)
    slot = np.fromiter(slots, np.int64, n)
    new = np.fromiter(itertools.chain.from_iterable(new_ids), np.int64)  # every new id, row-major
    counts = np.fromiter(map(len, new_ids), np.int64, n) if k_max > 1 else None  # [n]
    k = bucket(k_max, ks or (k_max,))
    length = bucket(int(held.max()) + 1 if counts is None else int((held + counts).max()), length_buckets)
    top = next_power_of_two(int(slot.max()) + 1)
    if dense is None:
        dense = top <= num_slots and 2 * n >= top
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
    in_order = not dense or bool((slot == np.arange(n)).all())
    return _plan(key, at, input_ids, positions, batch_slots, last_col, in_order)


def lay_out_blocks(
    held: np.ndarray,
    slot: np.ndarray,
    new: np.ndarray,
    counts: np.ndarray,
    *,
    k: int,
    length_buckets: tuple[int, ...],
    scratch: int,
    layer: int | None,
    last_only: bool,
) -> Plan:
    """Blocks of k: held, slot, counts [n] per item; new: their new ids chained, item-major.
    Item i's ids fill ceil(counts[i] / k) consecutive gathered rows."""
    n = len(counts)
    nb = -(-counts // k)  # [n] blocks per item
    total = int(nb.sum())
    rows = next_power_of_two(total)
    last = np.cumsum(nb) - 1  # [n] each item's last block row
    first = last - nb + 1
    item = np.repeat(np.arange(n), nb)  # [total] the item of each block
    j = np.arange(total) - first[item]  # [total] its index within the item
    start = j * k  # [total] the block's first new id, within its item
    count = np.minimum(k, counts[item] - start)  # [total] real ids in the block
    offset = np.concatenate(([0], np.cumsum(counts)[:-1]))  # [n] each item's first id in `new`
    columns = np.arange(k)
    real = columns[None, :] < count[:, None]  # [total, k]
    input_ids = np.zeros((rows, k), np.int64)
    positions = np.full((rows, k), scratch, np.int64)
    input_ids[:total] = np.where(real, new[np.minimum(offset[item, None] + start[:, None] + columns, len(new) - 1)], 0)
    positions[:total] = np.where(real, held[item, None] + start[:, None] + columns, scratch)
    last_col = np.zeros(rows, np.int64)
    last_col[:total] = count - 1
    batch_slots = np.zeros(rows, np.int64)  # padding rows read slot 0, write its scratch column
    batch_slots[:total] = slot[item]
    length = bucket(int((held + counts).max()), length_buckets)
    key = GraphKey(False, rows, k, length, last_only or k == 1, layer)
    return _plan(key, last, input_ids, positions, batch_slots, last_col, False, first)


def _plan(key: GraphKey, rows, input_ids, positions, slots, last_col, in_order: bool, first=None) -> Plan:
    """A Plan of numpy arrays, its tensors sharing their memory."""
    tensors = (torch.from_numpy(a) for a in (input_ids, positions, slots, last_col))
    return Plan(key, rows, *tensors, in_order=in_order, first=first)


@dataclass(frozen=True)
class Layout:
    """The forwards an extend runs: `groups[f]` are the items of forward f (consecutive,
    in order), each cut into blocks of `k`, or, with `dense`, one forward of one row per
    item (lay_out's dense view)."""

    k: int
    dense: bool
    groups: tuple[slice, ...]
    cost: float  # the forwards' replay times, summed (ms)


def _groups(nb: np.ndarray, max_rows: int) -> list[slice] | None:
    """Consecutive runs of items whose blocks fill at most max_rows rows; None if an item
    alone needs more."""
    if int(nb.max()) > max_rows:
        return None
    groups, start, filled = [], 0, 0
    for i, b in enumerate(nb.tolist()):
        if filled + b > max_rows:
            groups.append(slice(start, i))
            start, filled = i, 0
        filled += b
    groups.append(slice(start, len(nb)))
    return groups


def choose(
    held: np.ndarray,
    slot: np.ndarray,
    counts: np.ndarray,
    *,
    ks: tuple[int, ...],
    cost: Callable[[GraphKey], float | None],
    length_buckets: tuple[int, ...],
    num_slots: int,
    max_rows: int,
    max_forwards: int,
    layer: int | None,
    last_only: bool,
) -> Layout | None:
    """The fastest layout whose every forward has a captured graph (cost(key): its measured
    replay ms, None if none), in at most max_forwards forwards; None if there is none. For
    each k bucket: blocks of k (k at or above the longest row: one row per item, gathered)
    and, at the smallest k that holds the longest row, the dense view. Ties go to the dense
    view, then to fewer token slots, then to fewer rows."""
    k_max = int(counts.max())
    ends = held + counts  # [n]
    options: list[tuple[float, bool, int, int, Layout]] = []  # (cost, gathered, token slots, rows, layout)
    for k in ks:
        if k > k_max and k != bucket(k_max, ks):
            break  # larger ks only pad more
        nb = -(-counts // k)
        groups = _groups(nb, max_rows)
        if groups is None or len(groups) > max_forwards:
            continue
        total, rows_used = 0.0, 0
        for g in groups:
            rows = next_power_of_two(int(nb[g].sum()))
            ms = cost(GraphKey(False, rows, k, bucket(int(ends[g].max()), length_buckets), last_only or k == 1, layer))
            if ms is None:
                break
            total, rows_used = total + ms, rows_used + rows
        else:
            options.append((total, True, rows_used * k, rows_used, Layout(k, False, tuple(groups), total)))
        if k >= k_max:
            top = next_power_of_two(int(slot.max()) + 1)
            if top <= min(num_slots, max_rows):
                length = bucket(int(ends.max()), length_buckets)
                ms = cost(GraphKey(True, top, k, length, last_only or k == 1, layer))
                if ms is not None:
                    options.append((ms, False, top * k, top, Layout(k, True, (slice(0, len(counts)),), ms)))
    if not options:
        return None
    return min(options, key=lambda o: o[:4])[4]


def blocks(
    held: np.ndarray,
    slot: np.ndarray,
    new_ids: Sequence[Sequence[int]],
    counts: np.ndarray,
    layout: Layout,
    length_buckets: tuple[int, ...],
    scratch: int,
    layer: int | None,
    last_only: bool,
) -> list[tuple[Plan, slice]]:
    """The blocks plans of a layout chosen by `choose`, one per forward, with the items each holds."""
    new = np.fromiter(itertools.chain.from_iterable(new_ids), np.int64)
    starts = np.concatenate(([0], np.cumsum(counts)))
    return [
        (
            lay_out_blocks(
                held[g],
                slot[g],
                new[starts[g.start] : starts[g.stop]],
                counts[g],
                k=layout.k,
                length_buckets=length_buckets,
                scratch=scratch,
                layer=layer,
                last_only=last_only,
            ),
            g,
        )
        for g in layout.groups
    ]


def read_out(
    plans: list[tuple[Plan, slice]],
    outs: list[tuple[torch.Tensor, torch.Tensor | None]],
    new_ids: Sequence[Sequence[int]],
    last_only: bool,
    layer: int | None,
) -> list[Extension]:
    """Each item's outputs from its forwards' (logits [B, K or 1, V], hidden [B, K, d] | None):
    where every item wants its last logits only, one LastRows (nothing sliced per item);
    else per item, its blocks' rows in order."""
    n = len(new_ids)
    one_each = all(len(ids) == 1 for ids in new_ids)
    if (last_only and layer is None) or one_each:
        if len(plans) == 1:
            plan, (out, out_hidden) = plans[0][0], outs[0]
            index = None if plan.in_order else torch.from_numpy(plan.rows).to(out.device, non_blocking=True)
        else:  # the forwards' rows end to end: [sum B, 1, V]
            out, out_hidden = torch.cat([o for o, _ in outs]), None
            offsets = np.cumsum([0] + [plan.key.rows for plan, _ in plans[:-1]])
            rows = np.concatenate([plan.rows + offset for (plan, _), offset in zip(plans, offsets)])
            index = torch.from_numpy(rows).to(out.device, non_blocking=True)

        def items(t: torch.Tensor) -> torch.Tensor:  # [B, 1, X] -> [n, X], the items' rows in order
            return t[:n, 0] if index is None else t[:, 0].index_select(0, index)

        hidden = items(out_hidden) if out_hidden is not None and one_each else None
        batch = LastRows(items(out), hidden)
        return [Extension.row(batch, i) for i in range(n)]
    results: list[Extension] = []
    for (plan, group), (out, out_hidden) in zip(plans, outs):
        first = plan.rows if plan.first is None else plan.first
        for i, (a, b) in enumerate(zip(first.tolist(), plan.rows.tolist())):
            k = len(new_ids[group.start + i])
            # an item's blocks are consecutive rows, all full but the last: flattened in order
            # they are its new positions (one row per item: a = b)
            logits = out[b, -1:] if last_only else out[a : b + 1].reshape(-1, out.shape[-1])[:k]
            h = out_hidden[a : b + 1].reshape(-1, out_hidden.shape[-1])[:k] if out_hidden is not None else None
            results.append(Extension(logits, h))
    return results


def place_ids(input_ids: torch.Tensor, plan: Plan, on_device: torch.Tensor) -> None:
    """input_ids [B, 1] (the buffer the forward reads, on the device) <- on_device [n], item i's
    id at its row plan.rows[i]: queued on the device, nothing read back."""
    n = len(plan.rows)
    if plan.in_order:
        input_ids[:n, 0].copy_(on_device)
    else:
        index = torch.from_numpy(plan.rows).to(input_ids.device, non_blocking=True)
        input_ids[:, 0].index_copy_(0, index, on_device)
