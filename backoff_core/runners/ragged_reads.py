"""How far a ragged forward's attention reads (static_ragged.py), to price it: FlexAttention's
kernel runs one program per query block of BLOCK rows, and each program walks its key blocks
one after another. A catch-up has few query blocks (T * kv_heads * G / BLOCK: 8 at T = 32 at
the 8B shape, on 132 SMs), so the longest walk, not the FLOPs (~1% of the forward's), is what
long contexts add. CudaGraphs times each ragged graph near (its capture's inputs: one key block
a query block) and far (far_layout, `CudaGraphs.far`), and `auto` prices a catch-up between
the two by its longest walk (StaticRunner._ragged_ms). Host numpy only."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def key_blocks_read(positions: np.ndarray, slots: np.ndarray, groups: int, block: int) -> int:
    """The most key blocks one query block of a ragged forward reads: in FlexAttention's kernel
    a query block is one program, which walks its key blocks one after another, so where the
    programs are fewer than the GPU's multiprocessors (T * kvh * G / BLOCK of them) this walk
    sets the attention's time. A query block holds G-row runs of consecutive tokens of one kv
    head (block_mask's order); for each slot its tokens read, it reads the blocks up to the
    furthest position. positions, slots: [T] of the real tokens (padding reads one block)."""
    rows = np.arange(len(positions)) * groups
    qb = np.concatenate((rows // block, (rows + groups - 1) // block))  # a token's rows span <= two
    slot = np.concatenate((slots, slots))
    blocks = np.concatenate((positions, positions)) // block + 1
    width = int(slot.max()) + 1
    pairs = qb * width + slot
    order = np.argsort(pairs, kind="stable")
    pairs, blocks = pairs[order], blocks[order]
    first = np.flatnonzero(np.r_[True, pairs[1:] != pairs[:-1]])
    most = np.maximum.reduceat(blocks, first)  # per (query block, slot): blocks 0 .. the furthest position's
    return int(np.bincount(pairs[first] // width, weights=most).max())


def far_layout(tokens: int, free: Sequence[int], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A ragged forward's tokens laid out to read far (timing only, CudaGraphs.replay_ms): each
    in the next of the `free` slots in turn, at the column before the scratch one, so a query
    block reads every block of as many slots as it has tokens (up to len(free)). It writes only
    that column of free slots, which hold no session. Returns (positions, slots): [tokens]."""
    positions = np.full(tokens, max_len - 2, np.int64)
    return positions, np.asarray(free, np.int64)[np.arange(tokens) % len(free)]


def item_tokens(held: np.ndarray, slots: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Items of `counts` new tokens end to end, after `held` positions each, in their `slots`:
    (positions, slots) of every token, [sum(counts)] each."""
    starts = np.repeat(held - (np.cumsum(counts) - counts), counts)  # a token's position, less its index
    return starts + np.arange(int(counts.sum())), np.repeat(slots, counts)


def priced(near: float, far: tuple[int, float], read: int) -> float:
    """A ragged forward's estimated replay (ms): `near` (one key block a query block) plus the
    far timing's extra (far: its longest walk and ms) in proportion to the blocks past the first
    of this forward's longest walk `read`; never under `near`."""
    far_read, far_ms = far
    return near + max(0.0, far_ms - near) * (read - 1) / max(1, far_read - 1)
