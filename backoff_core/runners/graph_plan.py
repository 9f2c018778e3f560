"""Which CUDA graphs a StaticRunner captures: the buckets, and a budget on their number.

A graph is fixed by its GraphKey (dense/gather, rows, k, L, last_only, hidden_layer). The
set is a product, so it grows fast: rows (powers of two, dense and gathered) x k x L x the
variants a model is asked for. Capture costs time at load and one shared memory pool, so
the set is planned here, as a pure function of the runner's sizes, for warmup() and for
the meta-device plan (benchmarks/gpu_plan.py) alike:
  - L buckets grow by 4 from 256: at 1024 positions a batch reads 256 or 1024 keys per row.
    Reading up to 4x the keys a row needs costs little beside the weights (135M: 23 KB per
    position against 270 MB of weights; 8B: 128 KB against 15 GB) and halves the set.
  - rows: dense views 1, 2, 4, ... up to the slots, and gathered batches up to the power of
    two above them (an extend's blocks, static_layout.py, may take more rows than it has
    sessions), both within graph_max_rows.
  - kinds (k, last_only, hidden_layer), in priority order: every row x L bucket of a kind or
    none of it. Catch-ups that only need their last logits first (k = 1 .. 16, the M_S step
    and M_L's backoff catch-ups), then verification's full logits at the k that drafts of
    3-7 tokens need (4, 8), then 2 and 16. Kinds are taken whole while they fit the budget.
    With ragged catch-ups (static_ragged.py: one graph per token bucket, in the same budget)
    the last-logits k = 16 kind goes last: the long catch-ups it pads are what ragged
    forwards take, and verification's k = 8 keeps its place.
An extend whose k has no captured kind runs in the smallest captured k above it (padded),
or in chunks of the largest one (static.py), so only long prompt prefills run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

from backoff_core.runners.static_kv import next_power_of_two, powers_of_two

K_BUCKETS = (1, 2, 4, 8, 16)  # new tokens per row that graphs cover: M_S steps and short catch-ups
VERIFY_PRIORITY = (4, 8, 2, 16)  # k of full-logit (verification) catch-ups, most common first
MIN_LENGTH_BUCKET = 256
LENGTH_FACTOR = 4
GRAPH_BUDGET = 200  # graphs per model at most


@dataclass(frozen=True)
class GraphKey:
    """Everything that fixes a forward's shapes and Python branches."""

    dense: bool  # storage[:rows] view, or rows gathered by slot
    rows: int  # B: a power of two
    k: int  # new tokens per row (right-padded), a k bucket
    length: int  # L: keys read, a length bucket
    last_only: bool
    hidden_layer: int | None

    @property
    def size(self) -> int:
        return self.rows * self.k * self.length

    @property
    def token_slots(self) -> int:
        """Tokens the forward computes, padding included (a RaggedKey's the same)."""
        return self.rows * self.k


@dataclass(frozen=True)
class Kind:
    """A variant of the forward captured at every row and L bucket."""

    k: int
    last_only: bool
    hidden_layer: int | None


def length_buckets(max_len: int) -> tuple[int, ...]:
    """256, 1024, 4096, ... below max_len, then max_len itself."""
    return powers_of_two(min(MIN_LENGTH_BUCKET, max_len), max_len, LENGTH_FACTOR)


def row_buckets(slots: int, graph_max_rows: int) -> list[tuple[bool, int]]:
    """(dense, rows) pairs that a batch of these slots can take (static_layout.py): dense
    rows = the power of two above the highest slot, when it does not pass the slots;
    gathered rows = the power of two above the items, or above an extend's blocks."""
    top = next_power_of_two(slots)
    dense = [r for r in powers_of_two(1, top) if r <= min(slots, graph_max_rows)]
    gather = [r for r in powers_of_two(1, top) if r <= graph_max_rows]
    return [(True, r) for r in dense] + [(False, r) for r in gather]


def kinds(
    hidden_layers=(None,), last_only=(True, False), ks: tuple[int, ...] = K_BUCKETS, ragged: bool = False
) -> list[Kind]:
    """The kinds asked for, in capture priority (module docstring). One new token's logits
    are the last ones either way: k = 1 is always a last_only kind. ragged: the runner's
    catch-ups may run ragged, and the last-logits kinds of the largest k go last."""
    last = [k for k in ks if not (ragged and k == K_BUCKETS[-1])]
    out: list[Kind] = []
    if True in last_only:
        out += [Kind(k, True, layer) for k in last for layer in hidden_layers]
    if False in last_only:
        full = [k for k in VERIFY_PRIORITY if k in ks] + [k for k in ks if k not in VERIFY_PRIORITY]
        out += [Kind(k, k == 1, layer) for k in full for layer in hidden_layers]
    if True in last_only:
        out += [Kind(k, True, layer) for k in ks if k not in last for layer in hidden_layers]
    return list(dict.fromkeys(out))  # deduplicated, in order


def plan_keys(
    slots: int, max_len: int, graph_max_rows: int, wanted: list[Kind], budget: int = GRAPH_BUDGET
) -> list[GraphKey]:
    """The graphs to capture: whole kinds, in priority order, while they fit the budget."""
    rows = row_buckets(slots, graph_max_rows)
    lengths = length_buckets(max_len)
    keys: list[GraphKey] = []
    for kind in wanted:
        batch = [GraphKey(d, r, kind.k, n, kind.last_only, kind.hidden_layer) for d, r in rows for n in lengths]
        if len(keys) + len(batch) > budget:
            break
        keys += batch
    return keys
