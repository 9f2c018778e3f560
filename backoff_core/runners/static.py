"""A ModelRunner over static KV storage, replaying CUDA graphs on a GPU.

Same public surface and contract as `runner.ModelRunner` (sessions; `extend` appends
tokens to many sessions in one forward and returns their logits), so BackoffEngine and
CatchUpper use it unchanged. What differs is where the keys and values live and how the
forward runs:
  - storage (static_kv.py): per layer K/V [slots, kv_heads, max_len, head_dim] allocated
    once; slots = kv_budget_tokens // max_len (at least 1); a session owns the lowest free
    slot; extend writes in place at each row's own positions; crop only moves a length.
    With evict_idle (M_L), a session takes its slot at its first extend, and when none is
    free the least recently used sessions outside that extend are evicted (their requests
    re-prefill at their next catch-up, as with ModelRunner's budget); without it (M_S, whose
    sessions the step loop cannot rebuild) the slot is taken at open. No slot to be had, or a
    session passing max_len - 1 positions: KVCapacityError (retriable), raised before
    anything changes.
  - rows: a batch's rows are its sessions' slots. When the extending slots are dense
    (2 * sessions >= nb, nb = the power of two above the highest slot) the forward reads
    storage[:nb] as a view, idle rows riding along as padding; otherwise it gathers the
    sessions' rows (a copy of [n, kv_heads, L, head_dim] per layer).
  - buckets: rows are powers of two, new tokens per row k in {1, 2, 4, 8, 16} (ragged
    rows right-padded), keys read L in powers of two from 64 up to max_len. Padding tokens
    write to the scratch column max_len - 1 that no real query sees.
  - CUDA graphs (device cuda, cuda_graphs=True): `warmup()` captures one graph per bucket
    at load; extends inside the buckets replay one, others (a long prompt prefill: k > 16,
    or more rows than graph_max_rows) run the same forward eagerly. On the CPU everything
    runs eagerly.
The static forward supports Llama-structured models only (static_forward.check_supported);
others raise ValueError here, and the caller keeps ModelRunner for them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from backoff_core.runners.cuda_graphs import CudaGraphs, GraphKey
from backoff_core.runners.dynamic import Extension
from backoff_core.runners.scoring import Scoring, score_rows
from backoff_core.runners.sessions import Session, SessionTable
from backoff_core.runners.static_forward import Batch, StaticForward, check_supported
from backoff_core.runners.static_kv import KVCapacityError, StaticKV, bucket, next_power_of_two, powers_of_two

__all__ = ["KVCapacityError", "StaticRunner"]

K_BUCKETS = (1, 2, 4, 8, 16)  # new tokens per row that graphs cover: M_S steps and short catch-ups
MIN_LENGTH_BUCKET = 64


@dataclass(kw_only=True)
class _SlotSession(Session):
    slot: int | None  # its row of the static storage; None until its first extend (evict_idle)


@dataclass(frozen=True)
class _Plan:
    """One extend laid out as a bucketed batch (host tensors)."""

    key: GraphKey
    rows: list[int]  # the batch row of each item
    input_ids: torch.Tensor  # [B, K]
    positions: torch.Tensor  # [B, K]; padding at the scratch column
    slots: torch.Tensor  # [B]
    last_col: torch.Tensor  # [B]


class StaticRunner(SessionTable[_SlotSession]):
    """Holds one model, its static KV storage and its sessions. Thread-safe: one forward
    at a time. kv_budget_tokens: KV positions to preallocate across all sessions;
    max_len: positions per slot (a session holds at most max_len - 1: one is scratch)."""

    def __init__(
        self,
        model: PreTrainedModel,
        name: str = "model",
        *,
        kv_budget_tokens: int,
        max_len: int,
        cuda_graphs: bool = True,
        graph_max_rows: int = 64,
        evict_idle: bool = False,
    ) -> None:
        check_supported(model, max_len)  # before allocating anything
        super().__init__()
        self.model = model.eval()
        self.name = name
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.num_layers = int(model.config.num_hidden_layers)
        self.forward_passes = 0
        self.evict_idle = evict_idle
        self.evictions = 0  # sessions evicted to give their slot to another (evict_idle)
        self.eager_passes = 0  # forwards that ran without a graph (all of them on the CPU)
        self.kv = StaticKV(model, kv_budget_tokens, max_len, name)
        self._forward = StaticForward(model, self.kv)
        self.length_buckets = powers_of_two(min(MIN_LENGTH_BUCKET, max_len), max_len)
        use_graphs = cuda_graphs and self.device.type == "cuda"
        self.graph_max_rows = min(graph_max_rows, next_power_of_two(self.kv.slots))  # more rows never occur
        self.graphs = CudaGraphs(self._forward, self.graph_max_rows, K_BUCKETS[-1]) if use_graphs else None

    @property
    def max_positions(self) -> int:
        """Positions one session can hold (the engine refuses longer requests up front)."""
        return self.kv.max_len - 1

    # -- sessions (sessions.SessionTable; a crop only moves the length) -------------------
    def _new_session(self, request_id: str, refill: bool) -> _SlotSession:
        # refill changes nothing here: a session needs a slot either way
        return _SlotSession(slot=None if self.evict_idle else self.kv.take(), refill=refill)

    def _release(self, session: _SlotSession) -> None:
        if session.slot is not None:
            self.kv.give_back(session.slot)

    def kv_fits(self, items: list[tuple[str, int]]) -> bool:
        """Whether these sessions, each grown by its count of new positions, can extend
        together: each within a slot, and a slot for each that has none (every other session
        evicted if need be)."""
        with self._lock:
            sessions = [self._get(request_id) for request_id, _ in items]
            if any(s.length + n > self.kv.capacity for s, (_, n) in zip(sessions, items)):
                return False
            return sum(s.slot is None for s in sessions) <= self._obtainable_slots({r for r, _ in items})

    def _obtainable_slots(self, extending: set[str]) -> int:
        held = sum(s.slot is not None for r, s in self._sessions.items() if r not in extending)
        return self.kv.free_slots + (held if self.evict_idle else 0)

    def _reserve(self, items: list[tuple[str, list[int]]], sessions: list[_SlotSession]) -> None:
        """A slot for every session of this extend (under the lock): evict the least recently
        used sessions outside it while none is free; refuse, changing nothing, if even that
        leaves too few."""
        needing = [s for s in sessions if s.slot is None]
        if not needing:
            return
        extending = {request_id for request_id, _ in items}
        if len(needing) > self._obtainable_slots(extending):
            raise KVCapacityError(
                f"{self.name}: no KV slot for a new session: the sessions of this extend need "
                f"{sum(s.slot is not None for s in sessions) + len(needing)} of {self.kv.slots} slots "
                f"(kv_budget_tokens={self.kv.budget}); retry when a request ends"
            )
        idle = sorted((s.last_used, r) for r, s in self._sessions.items() if r not in extending and s.slot is not None)
        for _, request_id in idle[: max(0, len(needing) - self.kv.free_slots)]:
            self._release(self._sessions.pop(request_id))
            self.evictions += 1
        for s in needing:
            s.slot = self.kv.take()

    # -- warm-up --------------------------------------------------------------------------
    def warmup(
        self, hidden_layers=(None,), last_only=(True, False), ks: tuple[int, ...] = K_BUCKETS, progress: bool = True
    ) -> tuple[int, float]:
        """Capture the CUDA graphs of every bucket (rows x k x L x dense/gather x the given
        last_only and hidden_layer variants) now, at load; returns (graphs, seconds). A no-op
        without graphs (CPU). M_S only ever extends by one token per step: ks=(1,)."""
        if self.graphs is None:
            return 0, 0.0
        layers = [self._layer(n) for n in hidden_layers]
        keys = [
            GraphKey(dense, rows, k, length, lo or k == 1, layer)
            for dense, rows in self._row_buckets()
            for k in ks
            for length in self.length_buckets
            for lo in last_only
            for layer in layers
        ]
        with self._lock:
            seconds = self.graphs.capture(keys, progress)
        if progress:
            print(
                f"{self.name}: {len(self.graphs)} CUDA graphs captured in {seconds:.1f} s "
                f"({self.kv.slots} slots x {self.kv.max_len} positions, {self.kv.nbytes() / 2**30:.2f} GiB KV)"
            )
        return len(self.graphs), seconds

    def _row_buckets(self) -> list[tuple[bool, int]]:
        cap = min(self.graph_max_rows, self.kv.slots)
        dense = [r for r in powers_of_two(1, next_power_of_two(cap)) if r <= cap]
        gather = [r for r in powers_of_two(1, next_power_of_two(cap)) if r <= self.graph_max_rows]
        return [(True, r) for r in dense] + [(False, r) for r in gather]

    # -- forward --------------------------------------------------------------------------
    @torch.inference_mode()
    def extend(
        self,
        items: list[tuple[str, list[int]]],
        hidden_layer: int | None = None,
        last_only: bool = False,
        scoring: Sequence[Scoring | None] | None = None,
    ) -> list[Extension]:
        """Append tokens to sessions in one forward; returns one Extension per item (its
        logits at every new position, or at the last one only). scoring: per item, rows to
        score (scoring.py; such a forward computes every row's logits and keeps what is
        asked). Raises KVCapacityError, changing nothing, if a session would pass max_len - 1
        positions or no slot can be had."""
        if not items:
            return []
        scoring = list(scoring) if scoring is not None else [None] * len(items)
        if len(scoring) != len(items):
            raise ValueError(f"{self.name}: one scoring (or None) per item")
        for (_, ids), sc in zip(items, scoring):
            if sc is not None:
                sc.check(len(ids), self.vocab_size)
        scores = any(sc is not None for sc in scoring)
        with self._lock:
            sessions = self._extending(items)
            for (request_id, ids), s in zip(items, sessions):
                self.kv.check_room(request_id, s.length, len(ids))
            self._reserve(items, sessions)
            new_ids = [list(ids) for _, ids in items]
            plan = self._plan(sessions, new_ids, self._layer(hidden_layer), last_only and not scores)
            logits, hidden = self._run(plan)  # [B, K or 1, V], [B, K, d] | None
            self.forward_passes += 1
            now = time.monotonic()
            results = []
            for s, ids, row, sc in zip(sessions, new_ids, plan.rows, scoring):
                k = len(ids)
                s.length += k
                s.last_used = now
                h = hidden[row, :k] if hidden is not None else None
                if plan.key.last_only:
                    out = logits[row, :1]
                else:
                    out = logits[row, k - 1 : k] if last_only else logits[row, :k]
                scored = score_rows(logits[row, list(sc.rows)], sc.targets, sc.top_n) if sc is not None else None
                results.append(Extension(out, h, scored))
            return results

    def _layer(self, hidden_layer: int | None) -> int | None:
        """HF's hidden_states index (negative ones too) -> 0..num_layers."""
        if hidden_layer is None:
            return None
        count = self.num_layers + 1
        if not -count <= hidden_layer < count:
            raise ValueError(f"{self.name}: hidden_layer must be in [{-count}, {count}), got {hidden_layer}")
        return hidden_layer % count

    def _plan(
        self, sessions: list[_SlotSession], new_ids: list[list[int]], layer: int | None, last_only: bool
    ) -> _Plan:
        n, k_max = len(sessions), max(len(ids) for ids in new_ids)
        k = bucket(k_max, K_BUCKETS)  # k_max itself past 16: eager
        length = bucket(max(s.length + len(ids) for s, ids in zip(sessions, new_ids)), self.length_buckets)
        top = next_power_of_two(max(s.slot for s in sessions) + 1)
        dense = top <= self.kv.slots and 2 * n >= top
        rows = top if dense else next_power_of_two(n)
        batch_rows = [s.slot for s in sessions] if dense else list(range(n))
        # built as Python lists and turned into tensors once: per-row tensor ops would cost
        # ~10 us each, which at 64 rows is more than a captured step on a GPU
        input_ids = [[0] * k for _ in range(rows)]
        positions = [[self.kv.scratch] * k for _ in range(rows)]
        # gather: padding rows read slot 0 and write only its scratch column
        slots = list(range(rows)) if dense else [0] * rows
        last_col = [0] * rows
        for s, ids, r in zip(sessions, new_ids, batch_rows):
            input_ids[r][: len(ids)] = ids
            positions[r][: len(ids)] = range(s.length, s.length + len(ids))
            slots[r] = s.slot
            last_col[r] = len(ids) - 1
        # one new token: its logits are the last ones either way
        key = GraphKey(dense, rows, k, length, last_only or k == 1, layer)
        return _Plan(
            key,
            batch_rows,
            torch.tensor(input_ids),
            torch.tensor(positions),
            torch.tensor(slots),
            torch.tensor(last_col),
        )

    def _run(self, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.graphs is not None and plan.key in self.graphs:
            return self.graphs.replay(plan.key, plan.input_ids, plan.positions, plan.slots, plan.last_col)
        self.eager_passes += 1
        dev, key = self.device, plan.key
        batch = Batch(
            input_ids=plan.input_ids.to(dev),
            positions=plan.positions.to(dev),
            slots=plan.slots.to(dev),
            last_col=plan.last_col.to(dev),
            length=key.length,
            dense=key.dense,
            last_only=key.last_only,
            hidden_layer=key.hidden_layer,
        )
        logits, hidden = self._forward(batch)
        return logits.float(), hidden
