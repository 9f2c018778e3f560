"""A ModelRunner over static KV storage, replaying CUDA graphs on a GPU.

Same public surface and contract as `runner.ModelRunner` (sessions; `extend` appends
tokens to many sessions in one forward and returns their logits), so BackoffEngine and
CatchUpper use it unchanged. What differs is where the keys and values live and how the
forward runs:
  - storage (static_kv.py): per layer K/V [slots, kv_heads, max_len, head_dim] allocated
    once; slots = kv_budget_tokens // max_len (at least 1); a session owns the lowest free
    slot; extend writes in place at each row's own positions; crop only moves a length.
    With evict_idle (M_L), a session takes its slot at its first extend (static_slots.py),
    and when none is free the least recently used sessions outside that extend are evicted
    (their requests re-prefill at their next catch-up, as with ModelRunner's budget);
    without it (M_S, whose sessions the step loop cannot rebuild) the slot is taken at open.
    No slot to be had, or a session passing max_len - 1 positions: KVCapacityError
    (retriable), raised before anything changes.
  - layout (static_layout.py): rows are powers of two, new tokens per row k in {1, 2, 4, 8,
    16} (graph_plan.py; ragged rows right-padded, padding at a scratch column), keys read L
    in 256, 1024, ... up to max_len. One row per item (its slot's row of a dense view of
    storage[:nb], or gathered), or, for extends of several tokens a row, blocks: each item's
    new ids cut into rows of k, gathered, in one forward (a catch-up of 40 tokens: three
    rows of 16).
  - CUDA graphs (device cuda, cuda_graphs=True): `warmup()` captures the planned graphs at
    load (at most GRAPH_BUDGET) and times each replay; an extend of several tokens a row
    runs in the layout whose replays were measured fastest (static_layout.choose), in up to
    MAX_FORWARDS forwards; one that needs more (a long prompt prefill) runs the same forward
    eagerly, as does everything on the CPU.
Prefix cache (prefix_cache.py, on by default): `adopt_prefix` takes the fresh session's slot
and copies the cached blocks' K/V into its leading positions; extends copy full prompt blocks
out of the slot into the cache.
The static forward supports Llama-structured models only (static_forward.check_supported);
others raise ValueError here, and the caller keeps ModelRunner for them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from backoff_core.runners.cuda_graphs import CudaGraphs
from backoff_core.runners.extension import Extension
from backoff_core.runners.graph_plan import GRAPH_BUDGET, K_BUCKETS, GraphKey, kinds, length_buckets, plan_keys
from backoff_core.runners.prefix_cache import PrefixCache, PrefixCaching
from backoff_core.runners.scoring import Scoring, per_item
from backoff_core.runners.static_compiled import ATTENTION
from backoff_core.runners.static_forward import Batch, StaticForward, check_supported
from backoff_core.runners.static_kv import StaticKV, next_power_of_two
from backoff_core.runners.static_layout import Layout, Plan, blocks, choose, lay_out, place_ids, read_out
from backoff_core.runners.static_ragged import RaggedExtends, check_ragged
from backoff_core.runners.static_scored import ScoredExtends
from backoff_core.runners.static_slots import SlotSession, SlotSessions
from backoff_core.types import PrefixCacheSpec

__all__ = ["StaticRunner"]

# an extend runs as up to this many replays (blocks of a captured k, static_layout.choose);
# one that needs more (a long prompt prefill) as one eager forward, compute-bound there anyway
MAX_FORWARDS = 8


class StaticRunner(PrefixCaching, RaggedExtends, ScoredExtends, SlotSessions):
    """Holds one model, its static KV storage and its sessions. Thread-safe: one forward
    at a time. kv_budget_tokens: KV positions to preallocate across all sessions;
    max_len: positions per slot (a session holds at most max_len - 1: one is scratch).
    fuse_projections: q/k/v and gate/up as one GEMM each over copies of their weights
    (static_forward.py: fewer kernels a step, for a small model whose step they bound).
    ragged: catch-ups as ragged forwards, their tokens unpadded (static_ragged.py), wherever they
    apply; with ragged_if_faster, only where their replays were measured faster than the padded
    layout's (static_ragged.RaggedExtends._ragged_faster; without graphs nothing is timed, and
    the padded path runs).
    compile_layers: every decoder layer one inductor-compiled function (static_compiled.py;
    q/k/v and gate/up fused as views of one buffer), compiled at the first forward of each
    kind: warmup's captures on a GPU; attention: how a compiled layer attends
    (static_compiled.attend)."""

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
        prefix_cache: PrefixCacheSpec | None = PrefixCacheSpec(),
        fuse_projections: bool = False,
        ragged: bool = False,
        ragged_if_faster: bool = False,
        compile_layers: bool = False,
        attention: str = ATTENTION,
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
        self._forward = StaticForward(
            model, self.kv, fuse_projections=fuse_projections, compiled=compile_layers, attention=attention
        )
        self.length_buckets = length_buckets(max_len)
        use_graphs = cuda_graphs and self.device.type == "cuda"
        self.graph_max_rows = min(graph_max_rows, next_power_of_two(self.kv.slots))  # more rows never occur
        self.graphs = CudaGraphs(self._forward, self.graph_max_rows, K_BUCKETS[-1]) if use_graphs else None
        # (last_only, hidden_layer) -> the k captured for it, ascending (warmup)
        self._captured_ks: dict[tuple[bool, int | None], tuple[int, ...]] = {}
        self._wanted: tuple | None = None  # warmup's (hidden layers, last_only, ks, budget): capture_padded re-plans
        self.prefix_cache = PrefixCache(prefix_cache or PrefixCacheSpec(0))  # None: off
        # catch-ups (last logits, several tokens) as ragged forwards (static_ragged.py); with
        # graphs, warmup() captures one per token bucket; may change between extends
        self.ragged = ragged
        self.ragged_if_faster = ragged_if_faster
        if ragged:
            check_ragged(self.kv.max_len, self.device)

    extends_on_device = True  # extend(on_device=...): M_S's step launched ahead (engine/ahead.py)

    @property
    def max_positions(self) -> int:
        """Positions one session can hold (the engine refuses longer requests up front)."""
        return self.kv.max_len - 1

    # -- sessions (slot_sessions.SlotSessions; a crop only moves the length) --------------
    def _crop(self, session: SlotSession, length: int) -> None:
        self._crop_prefix(session, length)

    # -- prefix cache (prefix_cache.PrefixCaching) ----------------------------------------
    def _adoptable(self) -> int:
        return self.kv.capacity - 1  # at least one position left to feed

    def _read_kv(self, s: SlotSession, start: int, stop: int) -> torch.Tensor:
        return self.kv.read(s.slot, start, stop)

    def _write_kv(self, s: SlotSession, kv: torch.Tensor) -> None:
        self.kv.write(s.slot, kv)

    # -- warm-up --------------------------------------------------------------------------
    def warmup(
        self,
        hidden_layers=(None,),
        last_only=(True, False),
        ks: tuple[int, ...] = K_BUCKETS,
        progress: bool = True,
        budget: int = GRAPH_BUDGET,
    ) -> tuple[int, float]:
        """Capture the planned CUDA graphs (graph_plan.plan_keys: rows x L x the kinds of
        the given k, last_only and hidden_layer variants, whole kinds within `budget`) now,
        at load; returns (graphs, seconds). Without graphs (CPU, or cuda_graphs off) only a
        compiled ragged attention compiles (compile_ragged). M_S extends by one
        token a step, or two after a fully accepted draft: ks=(1, 2), last_only=(True,)."""
        if self.graphs is None:  # a compiled ragged attention still compiles now (compile_ragged)
            return 0, self._warm_ragged(progress) if self.ragged else 0.0
        self._wanted = ([self._layer(n) for n in hidden_layers], last_only, ks, budget)
        with self._lock:
            seconds = self._capture_planned(self.ragged, progress)
            if self.ragged:  # after the others: a first compile of FlexAttention that fails costs them nothing
                seconds += self._warm_ragged(progress)
        if progress:
            print(
                f"{self.name}: {len(self.graphs)} CUDA graphs captured and timed in {seconds:.1f} s "
                f"({self.kv.slots} slots x {self.kv.max_len} positions, {self.kv.nbytes() / 2**30:.2f} GiB KV)"
            )
        return len(self.graphs), seconds

    def _capture_planned(self, ragged: bool, progress: bool = False) -> float:
        """Capture and time warmup's plan of padded graphs (with ragged ones beside them, the
        budget less theirs and the k = 16 last-logits kind last: graph_plan.kinds); what is
        captured already stays. Returns seconds."""
        layers, last_only, ks, budget = self._wanted
        wanted = kinds(layers, last_only, ks, ragged=ragged)
        spare = budget - (len(self._ragged_keys()) if ragged else 0)
        keys = plan_keys(self.kv.slots, self.kv.max_len, self.graph_max_rows, wanted, spare)
        seconds = self.graphs.capture(keys, progress)
        captured: dict[tuple[bool, int | None], set[int]] = {}
        for key in self.graphs.ms.keys() | set(keys):
            if isinstance(key, GraphKey):
                captured.setdefault((key.last_only, key.hidden_layer), set()).add(key.k)
        self._captured_ks = {variant: tuple(sorted(got)) for variant, got in captured.items()}
        return seconds + self.graphs.time_replays(keys)  # what static_layout.choose weighs

    def capture_padded(self, progress: bool = False) -> float:
        """The padded plan of a runner without ragged catch-ups (the k = 16 last-logits kind that
        the ragged graphs' budget displaced): captured and timed where warmup's plan left it out.
        Called when ragged goes off after warmup (its check failed; a benchmark's padded rows).
        Returns seconds (0: nothing to do)."""
        if self.graphs is None or self._wanted is None:
            return 0.0
        with self._lock:
            return self._capture_planned(False, progress)

    def _ks(self, last_only: bool, layer: int | None) -> tuple[int, ...]:
        """The k an extend may be bucketed to: those captured for its variant (k = 1's logits
        are the last ones either way), or every k bucket without graphs."""
        if self.graphs is None:
            return K_BUCKETS
        ks = set(self._captured_ks.get((last_only, layer), ()))
        if 1 in self._captured_ks.get((True, layer), ()):
            ks.add(1)
        return tuple(sorted(ks))

    # -- forward --------------------------------------------------------------------------
    @torch.inference_mode()
    def extend(
        self,
        items: list[tuple[str, list[int]]],
        hidden_layer: int | None = None,
        last_only: bool = False,
        scoring: Sequence[Scoring | None] | None = None,
        on_device: torch.Tensor | None = None,
    ) -> list[Extension]:
        """Append tokens to sessions in one forward (or a few chunks of captured size);
        returns one Extension per item (its logits at every new position, or at the last one
        only). scoring: per item, rows to score (scoring.py; one eager forward, whose LM head
        with last_only runs on those rows and the last only). on_device: [n] long on this
        runner's device, the one new id of every item, read by the forward where it lies (an
        M_S step launched before its tokens are read back: engine/ahead.py); the items' own
        ids are then placeholders, except for the prefix cache, which stores them. Raises
        KVCapacityError, changing nothing, if a session would pass max_len - 1
        positions or no slot can be had."""
        if not items:
            return []
        if on_device is not None and (scoring is not None or any(len(ids) != 1 for _, ids in items)):
            raise ValueError(f"{self.name}: ids on the device take one new id an item, unscored")
        scoring = per_item(self.name, items, scoring, self.vocab_size) if scoring is not None else None
        with self._lock:
            sessions = self._extending(items)
            new_ids = [ids for _, ids in items]
            capacity = self.kv.capacity
            for (request_id, ids), s in zip(items, sessions):
                if s.length + len(ids) > capacity:
                    self.kv.check_room(request_id, s.length, len(ids))  # raises
            self._reserve(items, sessions)
            layer = self._layer(hidden_layer)
            if scoring is not None and any(sc is not None for sc in scoring):
                out = self._extend_scored(sessions, new_ids, layer, last_only, scoring)
                self._remember(sessions, new_ids)
                return out
            if on_device is not None:  # one row an item, in one forward (lay_out's rule)
                plan = self._plan(sessions, new_ids, layer, last_only)
                out = self._extend_plans(sessions, new_ids, layer, last_only, [(plan, slice(0, len(items)))], on_device)
                self._remember(sessions, new_ids)
                return out
            runs = self._ragged_runs(new_ids, layer, last_only)
            layout, padded_ms = None, None
            if runs is None or self.ragged_if_faster:
                layout, padded_ms = self._layout(sessions, new_ids, layer, last_only)
            if runs is not None and (
                not self.ragged_if_faster or self._ragged_faster(runs, padded_ms, sessions, new_ids)
            ):
                out = self._extend_ragged(sessions, new_ids, runs)
            else:
                plans = self._plans(sessions, new_ids, layer, last_only, layout)
                out = self._extend_plans(sessions, new_ids, layer, last_only, plans)
            self._remember(sessions, new_ids)
            return out

    def _layout(
        self, sessions: list[SlotSession], new_ids: list[list[int]], layer: int | None, last_only: bool
    ) -> tuple[Layout | None, float | None]:
        """The padded forwards an extend would run, and their measured replay ms summed: the
        fastest captured layout (static_layout.choose: blocks of k, or the dense view); None with
        one row per item: an M_S step or any extend without graphs (None: untimed), or, with no
        layout in MAX_FORWARDS forwards, one eager forward (a long prompt prefill,
        compute-bound there anyway: inf)."""
        n = len(new_ids)
        if self.graphs is None or max(map(len, new_ids)) == 1:
            return None, None
        layout = choose(
            np.fromiter((s.length for s in sessions), np.int64, n),
            np.fromiter((s.slot for s in sessions), np.int64, n),
            np.fromiter(map(len, new_ids), np.int64, n),
            ks=self._ks(last_only, layer),
            cost=self.graphs.ms.get,
            length_buckets=self.length_buckets,
            num_slots=self.kv.slots,
            max_rows=self.graph_max_rows,
            max_forwards=MAX_FORWARDS,
            layer=layer,
            last_only=last_only,
        )
        return layout, (math.inf if layout is None else layout.cost)

    def _plans(
        self,
        sessions: list[SlotSession],
        new_ids: list[list[int]],
        layer: int | None,
        last_only: bool,
        layout: Layout | None,
    ) -> list[tuple[Plan, slice]]:
        """The forwards of an extend (its `_layout`) and the items each holds."""
        n = len(new_ids)
        if layout is None or layout.dense:  # one row per item: lay_out's rule, or the dense view
            return [(self._plan(sessions, new_ids, layer, last_only, dense=True if layout else None), slice(0, n))]
        held = np.fromiter((s.length for s in sessions), np.int64, n)
        slot = np.fromiter((s.slot for s in sessions), np.int64, n)
        counts = np.fromiter(map(len, new_ids), np.int64, n)
        return blocks(held, slot, new_ids, counts, layout, self.length_buckets, self.kv.scratch, layer, last_only)

    def _extend_plans(
        self,
        sessions: list[SlotSession],
        new_ids: list[list[int]],
        layer: int | None,
        last_only: bool,
        plans: list[tuple[Plan, slice]],
        on_device: torch.Tensor | None = None,
    ) -> list[Extension]:
        """Run the forwards in order (an item's blocks see the keys of its earlier ones, written
        by then) and hand each item its outputs (static_layout.read_out). on_device: extend's,
        with one plan."""
        outs = []
        for plan, _ in plans:
            outs.append(self._run(plan, on_device=on_device))  # [B, K or 1, V], [B, K, d] | None
            self.forward_passes += 1
        now = time.monotonic()
        for s, ids in zip(sessions, new_ids):
            s.length += len(ids)
            s.last_used = now
        return read_out(plans, outs, new_ids, last_only, layer)

    def _layer(self, hidden_layer: int | None) -> int | None:
        """HF's hidden_states index (negative ones too) -> 0..num_layers."""
        if hidden_layer is None:
            return None
        count = self.num_layers + 1
        if not -count <= hidden_layer < count:
            raise ValueError(f"{self.name}: hidden_layer must be in [{-count}, {count}), got {hidden_layer}")
        return hidden_layer % count

    def _plan(
        self,
        sessions: list[SlotSession],
        new_ids: list[list[int]],
        layer: int | None,
        last_only: bool,
        dense: bool | None = None,
    ) -> Plan:
        return lay_out(
            [s.length for s in sessions],
            [s.slot for s in sessions],
            new_ids,
            ks=self._ks(last_only, layer),
            length_buckets=self.length_buckets,
            num_slots=self.kv.slots,
            scratch=self.kv.scratch,
            layer=layer,
            last_only=last_only,
            dense=dense,
        )

    def _run(
        self, plan: Plan, columns: list[list[int]] | None = None, on_device: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """columns: per item, the new-id columns whose logits to compute (eager); None: the
        plan's. on_device: [n] the items' ids (one each), placed into the uploaded ids."""
        place = None if on_device is None else lambda batch: place_ids(batch.input_ids, plan, on_device)
        if columns is None and self.graphs is not None and plan.key in self.graphs:
            return self.graphs.replay(plan.key, plan.input_ids, plan.positions, plan.slots, plan.last_col, place)
        self.eager_passes += 1
        key = plan.key
        keep = None
        if columns is not None:  # [rows, C], padded with each row's last column (idle rows: 0)
            width = max(len(c) for c in columns)
            table = [[0] * width for _ in range(key.rows)]
            for r, cols in zip(plan.rows.tolist(), columns):
                table[r] = cols + [cols[-1]] * (width - len(cols))
            keep = torch.tensor(table, device=self.device)
        inputs = (plan.input_ids, plan.positions, plan.slots, plan.last_col)
        if self.graphs is not None and self.graphs.fits(key):  # the same one upload as a replay
            up = self.graphs.upload(*inputs)
            inputs = (up.input_ids, up.positions, up.slots, up.last_col)
        else:
            inputs = tuple(t.to(self.device) for t in inputs)
        batch = Batch(*inputs, key.length, key.dense, key.last_only, key.hidden_layer, keep)
        if place is not None:
            place(batch)
        logits, hidden = self._forward(batch)
        return logits.float(), hidden
