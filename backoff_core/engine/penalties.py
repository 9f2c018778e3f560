"""Presence, frequency and repetition penalties' counts, kept on the logits' device.

A penalty reads every token before the position it draws at, so recounting them on the host
at every draw costs O(sequence) per request per step, and uploading them as (row, id, value)
triples as much again: at 64 streams and a few hundred tokens that was tens of ms a step,
ten times a GPU step. Instead each penalized request keeps a `PenaltyCounts`: a [V] row of
its generated ids' counts and its prompt's ids as a mask, on the device, as of some position
`upto`. A batch stacks its rows' counts and adds, in one upload, the few tokens between each
row's position and its request's `upto` (committed since: +1; a catch-up's earlier position,
or dropped by a rollback: -1); each request's furthest row then becomes its counts. So the
host work of a draw is that of the tokens committed since the last one, whatever the length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backoff_core.engine.state import Live, PenaltyCounts
from backoff_core.sampling import Penalties


def penalties_at(rows: Sequence[tuple[Live, int]], logits: torch.Tensor) -> Penalties | None:
    """rows: (request, the position its row of `logits` [B, V] draws at) per row -> the
    penalized rows' counts and seen masks at their positions, None if no row is penalized.
    Brings each request's counts up to its furthest row."""
    at = tuple(i for i, (r, _) in enumerate(rows) if r.penalized)
    if not at:
        return None
    vocab, device = logits.shape[-1], logits.device
    _open([rows[i][0] for i in at if rows[i][0].penalty is None], vocab, device)
    states = [rows[i][0].penalty for i in at]
    counts = _stack([s.counts for s in states], vocab, device)  # [P, V]
    deltas: list[tuple[int, int, float]] = []  # (row of counts, id, +-1)
    furthest: dict[str, int] = {}  # request id -> its row of counts at the furthest position
    for k, (i, state) in enumerate(zip(at, states)):
        r, position = rows[i]
        tokens = r.tokens
        # an id past this width (a wider model's token) counts nothing here, as in _fit; on a
        # GPU an index past the row would be a device-side assert, not one request's error
        if state.dropped:
            deltas += [(k, t, -1.0) for t in state.dropped if t < vocab]
        if position > state.upto:
            deltas += [(k, t, 1.0) for t in tokens[state.upto : position] if t < vocab]
        elif position < state.upto:
            deltas += [(k, t, -1.0) for t in tokens[position : state.upto] if t < vocab]
        best = furthest.get(r.request_id)
        if best is None or position > rows[at[best]][1]:
            furthest[r.request_id] = k
    if deltas:
        # [3, D] float64 (rows and ids < 2^31 are exact in it): one upload
        table = torch.tensor(deltas, dtype=torch.float64).T.to(device, non_blocking=True)
        counts.index_put_((table[0].long(), table[1].long()), table[2].float(), accumulate=True)
    if device.type == "cuda":
        _in_use_here([states[k].counts for k in furthest.values()], device)
    for k in furthest.values():  # a view of this batch's counts: read, never written again
        state = states[k]
        if state.counts.shape[0] == vocab:  # not a cut or padded row: that would lose or add ids
            state.counts, state.upto, state.dropped = counts[k], rows[at[k]][1], []
    params = [rows[i][0].request.sampling for i in at]
    # [P, 4] float64: row, repetition, presence, frequency (rows < 2^31 are exact in it); one upload
    table = torch.tensor(
        [(i, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) for i, s in zip(at, params)],
        dtype=torch.float64,
    ).to(device, non_blocking=True)
    seen = repetition = subtract = None
    if any(s.repetition_penalty != 1.0 for s in params):
        seen = (counts > 0) | _stack([s.prompt for s in states], vocab, device)
        repetition = table[:, 1, None].float()
    if any(s.presence_penalty or s.frequency_penalty for s in params):
        exact = counts.double()
        subtract = (table[:, 2, None] * (exact > 0) + table[:, 3, None] * exact).float()
    return Penalties(table[:, 0].long(), counts, seen, repetition, subtract, at)


def _stack(rows: list[torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """[V'] rows -> [P, vocab] on `device`. A row of another width (a model whose logits are
    padded wider or narrower than the one that opened it) is cut or padded: the ids past V'
    count nothing."""
    try:
        stacked = torch.stack(rows)
    except RuntimeError:  # widths or devices differ: stack refuses
        stacked = None
    if stacked is None or stacked.shape[1] != vocab:
        return torch.stack([_fit(row, vocab, device) for row in rows])
    return stacked.to(device, non_blocking=True)


def _in_use_here(rows: list[torch.Tensor], device: torch.device) -> None:
    """The counts a fold replaces are freed now, on the host, while the stack that read them
    may still be queued on this stream. A catch-up in flight (flight.py) runs on a side stream:
    a block it frees would go back to the stream that allocated it, whose next kernels could
    overwrite it first. Recording this stream's use keeps the block until its work is done
    (one call per storage: a batch's rows share one)."""
    stream = torch.cuda.current_stream(device)
    for row in {row.untyped_storage().data_ptr(): row for row in rows}.values():
        row.record_stream(stream)


def _open(fresh: list[Live], vocab: int, device: torch.device) -> None:
    """Zero counts and the prompt's mask for requests that draw penalized for the first time."""
    fresh = list({r.request_id: r for r in fresh}.values())
    if not fresh:
        return
    prompts = torch.zeros(len(fresh), vocab, dtype=torch.bool)  # on the host: one upload for all
    for k, r in enumerate(fresh):
        prompts[k, [t for t in r.request.prompt_ids if t < vocab]] = True
    prompts = prompts.to(device, non_blocking=True)
    zeros = torch.zeros(len(fresh), vocab, device=device)
    for k, r in enumerate(fresh):
        r.penalty = PenaltyCounts(counts=zeros[k], prompt=prompts[k], upto=r.prompt_len)


def _fit(row: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """A request's [V'] row on `device` at width `vocab` (a model whose logits are padded
    wider or narrower than the one that opened it: the ids past V' count nothing)."""
    row = row.to(device)
    if row.shape[0] >= vocab:
        return row[:vocab]
    wider = row.new_zeros(vocab)
    wider[: row.shape[0]] = row
    return wider
