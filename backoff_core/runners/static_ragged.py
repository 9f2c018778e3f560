"""Ragged extends: an extend's new tokens flat, without padding to rows (M_L's catch-ups:
StaticRunner(ragged=True); KVSpec ragged "auto", the default on CUDA, takes them per catch-up
where their replays were timed faster than the padded layout's, ragged_if_faster).

The blocks layout (static_layout.py) pads each item's tokens to rows of k, the rows to a power
of two, and gathers a copy of each row's slot for its attention: on the H100 at b=0.9 a third
of M_L's token slots held padding (docs/gpu.md). Here the T new tokens of an extend run as one
sequence [1, T] through the embeddings, projections, MLP and LM head, padded only to a token
bucket (RAGGED_TOKENS), and each token attends over its own slot up to its own position,
read straight from the storage: FlexAttention over a layer's K/V seen as ONE sequence of
slots x kv_heads x max_len keys, with a block mask built in the forward from the tokens'
slots and positions, so a query block reads only its tokens' slots' blocks up to their
positions. No gathered copies, no length bucket, no rows.

  queries  [1, 1, kvh * T * G, D], ordered (kv head, token, group): a query block holds one kv
           head's queries of consecutive tokens (an item's tokens are consecutive), so it
           reads few key blocks;
  keys     storage [S, kvh, M, D] viewed [1, 1, S * kvh * M, D] (contiguous: no copy);
  visible  key (s, h, p) to query (h', t): s == slot[t], h == h', p <= position[t]; a padding
           token (position = the scratch column, slot 0) sees the scratch key alone.

On CUDA the attention is torch.compile(flex_attention) (Triton kernels, compiled at warm-up
and captured in the graph); elsewhere the eager flex_attention, which materialises the whole
score matrix: right for tests over tiny models, not a CPU path for real ones (the factory
keeps the blocks layout there). Replays are timed at load twice: on the capture's inputs,
every query block reading one key block, and laid out far (ragged_reads.py), every query block
reading every block of as many slots as it holds tokens. A query block is one program of the
kernel, which walks its key blocks one after another, and a catch-up has few of them (T * kvh
* G / BLOCK), so `auto` prices a catch-up's ragged forward between the two by the most key
blocks one of its query blocks reads: its FLOPs are ~1% of the 8B forward's,
but the walk is serial. Nothing reads a device value to the host, so a CUDA graph can capture
it (test_capture_safety.py).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from tqdm import tqdm

from backoff_core.runners.extension import Extension, LastRows
from backoff_core.runners.ragged_reads import item_tokens, key_blocks_read, priced

log = logging.getLogger(__name__)

# token buckets of a ragged forward (one CUDA graph each): an extend's T new tokens run in the
# smallest that holds them; M_L's catch-ups at 64 streams and b=0.9 carry ~100-600 tokens
RAGGED_TOKENS = (32, 64, 128, 192, 256, 384, 512, 768, 1024)
# a ragged catch-up's logits this far from the padded path's (relative, over the check's items)
# are wrong, not rounding: bf16 rounds to ~1e-2 (warm-up's check turns ragged off past it)
RAGGED_TOLERANCE = 0.1
# warm-up's check (ragged_rel_err): its sessions' prompt lengths, each capped at half a slot; at
# max_len 1024 they reach blocks 0-2 of their slots, so the check reads past a slot's first block
CHECK_PROMPTS = (40, 300, 77, 200, 140, 260)
BLOCK = 128  # FlexAttention's block (queries and keys); a slot's keys are max_len / BLOCK blocks
# the query-side block lists serve the backward only: not built, where this torch can skip them
NO_Q_BLOCKS = (
    {"compute_q_blocks": False} if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters else {}
)


@dataclass(frozen=True)
class RaggedKey:
    """A ragged forward's CUDA graph: its token bucket fixes every shape."""

    tokens: int

    @property
    def size(self) -> int:  # captures go largest first (cuda_graphs.py)
        return self.tokens

    @property
    def token_slots(self) -> int:  # as GraphKey's: the tokens the forward computes
        return self.tokens


class RaggedRun(NamedTuple):
    """Consecutive items of a catch-up that one ragged forward runs: their tokens fill `key`'s bucket."""

    items: slice
    key: RaggedKey


@dataclass(frozen=True)
class RaggedBatch:
    """One ragged forward's inputs, on the model's device (T: a token bucket; R: max items)."""

    input_ids: torch.Tensor  # [T] long; padding tokens: any id
    positions: torch.Tensor  # [T] long: rope position and KV column (padding: the scratch column)
    slots: torch.Tensor  # [T] long: each token's storage slot (padding: 0)
    last: torch.Tensor  # [R] long: index in [0, T) of each item's last token (unused rows: 0)


def ragged_bucket(tokens: int) -> int | None:
    """The smallest token bucket that holds `tokens`, or None past the largest."""
    return next((b for b in RAGGED_TOKENS if b >= tokens), None)


def lay_out_ragged(
    held: Sequence[int], slots: Sequence[int], new_ids: Sequence[Sequence[int]], scratch: int, rows: int
) -> tuple[int, list[torch.Tensor]]:
    """An extend's items end to end (host tensors): (T, [ids, positions, token slots: [T];
    last: [rows], each item's last token]); the tokens past the items, to the bucket T, are
    padding at the scratch column of slot 0."""
    counts = np.fromiter(map(len, new_ids), np.int64, len(new_ids))
    ends = np.cumsum(counts)
    total = int(ends[-1])
    t = ragged_bucket(total)
    ids = np.zeros(t, np.int64)
    ids[:total] = np.fromiter((i for item in new_ids for i in item), np.int64, total)
    positions = np.full(t, scratch, np.int64)
    token_slots = np.zeros(t, np.int64)
    positions[:total], token_slots[:total] = item_tokens(
        np.asarray(held, np.int64), np.asarray(slots, np.int64), counts
    )
    last = np.zeros(rows, np.int64)
    last[: len(counts)] = ends - 1
    return t, [torch.from_numpy(a) for a in (ids, positions, token_slots, last)]


def block_size(max_len: int) -> int:
    """Key blocks must not straddle two (slot, kv head) runs of max_len keys."""
    return math.gcd(max_len, BLOCK)


def check_ragged(max_len: int, device: torch.device) -> None:
    """On CUDA, FlexAttention's kernels take blocks of BLOCK: a slot's keys must fill whole ones."""
    if device.type == "cuda" and max_len % BLOCK:
        raise ValueError(f"ragged extends on CUDA need max_len a multiple of {BLOCK}, got {max_len}")


def block_mask(b: RaggedBatch, slots: int, kv_heads: int, groups: int, max_len: int) -> BlockMask:
    """The visibility above as a FlexAttention BlockMask, built on the device with fixed shapes:
    marks [query blocks, key blocks] set where a token's queries meet its slot's blocks from
    the first it sees to the last, then each query block's key blocks listed (argsort)."""
    t = b.input_ids.shape[0]
    dev = b.positions.device
    block = block_size(max_len)
    scratch = max_len - 1
    per = max_len // block  # key blocks per (slot, kv head)
    q_len, kv_len = kv_heads * t * groups, slots * kv_heads * max_len
    q_blocks, kv_blocks = -(-q_len // block), slots * kv_heads * per
    slot, position = b.slots, b.positions  # [T]
    padding = position >= scratch
    hi = position // block  # [T]: the last block a token sees
    lo = torch.where(padding, hi, torch.zeros_like(hi))  # padding: the scratch block alone
    head = torch.arange(kv_heads, device=dev)[:, None, None]  # [kvh, 1, 1]
    token = torch.arange(t, device=dev)[None, :, None]  # [1, T, 1]
    pb = torch.arange(per, device=dev)[None, None, :]  # [1, 1, per]
    kb = ((slot[None, :, None] * kv_heads + head) * per + pb).expand(kv_heads, t, per)  # [kvh, T, per]
    seen = (pb >= lo[None, :, None]) & (pb <= hi[None, :, None])  # [kvh, T, per]
    first_row = (head * t + token) * groups  # [kvh, T, 1]: the token's first query row
    marks = torch.zeros(q_blocks + 1, kv_blocks, dtype=torch.bool, device=dev)  # last row: unseen
    one = torch.ones((), dtype=torch.bool, device=dev)
    for row in (first_row, first_row + groups - 1):  # a token's G rows span at most two blocks
        qb = torch.where(seen, (row // block).expand(kv_heads, t, per), q_blocks)
        marks.index_put_((qb, kb), one)
    marks = marks[:q_blocks]
    count = marks.sum(-1, dtype=torch.int32)  # [QB]
    order = torch.argsort(marks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)

    def visible(_b, _h, q, k):
        tok = (q // groups) % t
        s, h, p = k // (kv_heads * max_len), (k // max_len) % kv_heads, k % max_len
        pos = position[tok]
        return (s == slot[tok]) & (h == q // (t * groups)) & (p <= pos) & ((pos < scratch) | (p == pos))

    return BlockMask.from_kv_blocks(
        count[None, None],
        order[None, None],
        BLOCK_SIZE=block,
        mask_mod=visible,
        seq_lengths=(q_len, kv_len),
        **NO_Q_BLOCKS,
    )


def attention_fn(device: torch.device):
    """flex_attention, compiled on CUDA (its fused kernel; eager materialises every score)."""
    if device.type != "cuda":
        return flex_attention
    # one compile per token bucket (static shapes): past the default limit of 8 a function, a
    # fullgraph compile raises (FailOnRecompileLimitHit; warm-up would turn ragged off)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(RAGGED_TOKENS))
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def ragged_attention(
    flex, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: BlockMask, scale: float
) -> torch.Tensor:
    """q [T, kvh * G, D] (HF's head order: kv head major) over storage keys/values [S, kvh,
    M, D] -> [T, kvh * G * D]."""
    t, heads, d = q.shape
    kvh = keys.shape[1]
    g = heads // kvh
    queries = q.view(t, kvh, g, d).permute(1, 0, 2, 3).reshape(1, 1, kvh * t * g, d)
    out = flex(queries, keys.view(1, 1, -1, d), values.view(1, 1, -1, d), block_mask=mask, scale=scale)
    return out.view(kvh, t, g, d).permute(1, 0, 2, 3).reshape(t, heads * d)


class RaggedExtends:
    """StaticRunner's ragged extends (a mixin: `ragged`, `ragged_if_faster`, `graphs`, `graph_max_rows`, `kv`,
    `_forward` and the pass counters are the runner's)."""

    def capture_ragged(self, progress: bool = True) -> tuple[int, float]:
        """Capture and time one graph per token bucket; a no-op without graphs. warmup() calls
        it last when `ragged` is set; called after warmup (to measure ragged forwards beside
        the padded ones) it adds up to len(RAGGED_TOKENS) graphs past warmup's budget.
        Returns (graphs, seconds)."""
        if self.graphs is None:
            return 0, 0.0
        check_ragged(self.kv.max_len, self.device)
        keys = self._ragged_keys()
        with self._lock:  # timed far over the slots no session holds (all of them at load)
            seconds = self.graphs.capture(keys, progress) + self.graphs.time_replays(keys, self.kv.free_slot_ids())
        return len(keys), seconds

    def _warm_ragged(self, progress: bool) -> float:
        """capture_ragged at warmup (without graphs, compile_ragged), then, where something was
        compiled, a catch-up checked against the padded path's (ragged_rel_err). Where either
        fails (FlexAttention's first compile on a new device, a kernel that computes wrong) the
        runner keeps its padded graphs and path, with a warning, and serves; its padded plan
        then gets back the graphs the ragged ones had displaced (capture_padded)."""
        try:
            if self.graphs is None and self._forward.attention() is flex_attention:
                return 0.0  # the eager attention: nothing compiles, nothing new to check
            start = time.perf_counter()
            if self.graphs is not None:
                self.capture_ragged(progress)
            else:
                self.compile_ragged(progress)
            if (err := self.ragged_rel_err()) > RAGGED_TOLERANCE:
                raise ValueError(f"a catch-up's logits {err:.3f} from the padded path's (over {RAGGED_TOLERANCE})")
            return time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - the padded path is whole: serve on it
            if self.graphs is not None:
                self.graphs.forget(self._ragged_keys())
            self.ragged = False
            log.warning("%s: ragged catch-ups off, their warm-up failed (%r); the padded path serves", self.name, exc)
            return self.capture_padded(progress)  # the padded graphs the ragged ones had displaced

    def ragged_rel_err(self, prompt_ids: Sequence[int] | None = None) -> float:
        """Up to six sessions take prompts of CHECK_PROMPTS tokens (up to half a slot; from
        `prompt_ids` repeated, default fixed ids), so that their keys fill several key blocks at
        the real max_len, then one catch-up of items of 2 to 37 tokens, once ragged and once
        padded: the relative error of its last logits, ragged against padded (raises if the
        catch-up would not run ragged). Runs as serving does (its own sessions, closed after;
        the pass and eviction counters as they were; after load, idle sessions of a runner that
        evicts may be evicted for its slots), with the runner's ragged settings restored,
        whatever raises."""
        cap = self.kv.max_len - 1
        base = list(prompt_ids) if prompt_ids is not None else [(7 * j + 3) % self.vocab_size for j in range(40)]
        n = min(len(CHECK_PROMPTS), self.kv.slots)
        prompts = [(base * (length // len(base) + 1))[: max(1, min(length, cap // 2))] for length in CHECK_PROMPTS[:n]]
        settings = (self.ragged, self.ragged_if_faster, self.forward_passes, self.eager_passes, self.evictions)
        logits = {}
        try:
            for ragged in (False, True):
                self.ragged, self.ragged_if_faster = ragged, False
                sids = [f"ragged-check-{ragged}-{i}" for i in range(n)]
                try:
                    for request_id in sids:
                        self.open(request_id)
                    self.extend(list(zip(sids, prompts)), last_only=True)
                    items = [(r, base[: min(2 + 7 * i, cap - len(p))]) for i, (r, p) in enumerate(zip(sids, prompts))]
                    if ragged and self._ragged_runs([ids for _, ids in items], None, True) is None:
                        raise ValueError("the check's catch-up has no ragged forward to run (a bucket not captured)")
                    logits[ragged] = torch.stack([e.last for e in self.extend(items, last_only=True)]).float()
                finally:  # closing one that never opened does nothing
                    for request_id in sids:
                        self.close(request_id)
        finally:
            self.ragged, self.ragged_if_faster, self.forward_passes, self.eager_passes, self.evictions = settings
        return float((logits[True] - logits[False]).norm() / logits[False].norm())

    def compile_ragged(self, progress: bool = True) -> float:
        """Without graphs (`cuda_graphs=False`): one ragged forward per token bucket, every token
        padding (the scratch column of slot 0), so a compiled attention (CUDA's) compiles now and
        not at each bucket's first catch-up; nothing to do for the eager one. Returns seconds."""
        if self._forward.attention() is flex_attention:
            return 0.0  # eager: nothing to compile
        check_ragged(self.kv.max_len, self.device)
        start = time.perf_counter()
        last = torch.zeros(self.graph_max_rows, dtype=torch.long, device=self.device)
        with self._lock, torch.inference_mode():  # as extend() runs it: the compile's guards hold
            for t in tqdm(self._ragged_buckets(), desc=f"{self.name}: ragged", disable=not progress):
                ids = torch.zeros(t, dtype=torch.long, device=self.device)
                self._forward.ragged(RaggedBatch(ids, torch.full_like(ids, self.kv.scratch), ids, last))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _ragged_buckets(self) -> list[int]:
        """The token buckets this runner's ragged forwards use: those its graphs' inputs hold,
        or without graphs those up to the one that holds the whole storage (no extend holds more)."""
        top = self.graphs.n if self.graphs is not None else ragged_bucket(self.kv.slots * self.kv.max_len)
        return [t for t in RAGGED_TOKENS if top is None or t <= top]

    def _ragged_keys(self) -> list[RaggedKey]:
        return [RaggedKey(t) for t in self._ragged_buckets()]

    def _ragged_runs(self, new_ids: list[list[int]], layer: int | None, last_only: bool) -> list[RaggedRun] | None:
        """A catch-up (several tokens, the last logits only) with ragged on: its items in runs of
        consecutive ones whose tokens fill a bucket at most (a forward each, each bucket's
        graph captured where there are graphs); None, the padded path: ragged off, other
        logits, a step (one token a row pads nothing), more items than the output rows, or an
        item longer than the largest bucket."""
        if not (self.ragged and last_only and layer is None and len(new_ids) <= self.graph_max_rows):
            return None
        if max(map(len, new_ids)) == 1:
            return None
        top = max(self._ragged_buckets(), default=0)
        runs, start, tokens = [], 0, 0
        for i, ids in enumerate(new_ids):
            if len(ids) > top:
                return None
            if tokens + len(ids) > top:
                runs.append(RaggedRun(slice(start, i), RaggedKey(ragged_bucket(tokens))))
                start, tokens = i, 0
            tokens += len(ids)
        runs.append(RaggedRun(slice(start, len(new_ids)), RaggedKey(ragged_bucket(tokens))))
        if self.graphs is not None and any(run.key not in self.graphs for run in runs):
            return None
        return runs

    def _ragged_faster(self, runs: list[RaggedRun], padded_ms: float | None, sessions: list, new_ids: list) -> bool:
        """Whether the ragged forwards of `runs` replay faster than the padded layout's forwards
        (padded_ms: their measured replays summed, inf for an eager forward, None untimed: no
        graphs). A tie, or nothing timed, keeps the padded path."""
        if padded_ms is None or self.graphs is None:
            return False
        return sum(self._ragged_ms(run, sessions, new_ids) for run in runs) < padded_ms

    def _ragged_ms(self, run: RaggedRun, sessions: list, new_ids: list) -> float:
        """A ragged forward's estimated replay: its bucket's time at one key block a query block,
        plus the far timing's extra (CudaGraphs.far) in proportion to the key blocks past the
        first that its query blocks read at most (key_blocks_read); the near time alone where
        nothing was timed far."""
        near = self.graphs.ms.get(run.key, math.inf)
        if (far := self.graphs.far.get(run.key)) is None or not math.isfinite(near):
            return near
        counts = np.fromiter(map(len, new_ids[run.items]), np.int64)
        held = np.fromiter((s.length for s in sessions[run.items]), np.int64, len(counts))
        slots = np.fromiter((s.slot for s in sessions[run.items]), np.int64, len(counts))
        positions, token_slots = item_tokens(held, slots, counts)
        read = key_blocks_read(positions, token_slots, self._forward.groups, block_size(self.kv.max_len))
        return priced(near, far, read)

    def _extend_ragged(self, sessions: list, new_ids: list[list[int]], runs: list[RaggedRun]) -> list[Extension]:
        """A ragged forward per run of items: their tokens end to end, padded to a token bucket
        at the scratch column of slot 0; each item's logits after its last (one LastRows)."""
        parts = []
        for run, _ in runs:
            t, inputs = lay_out_ragged(
                [s.length for s in sessions[run]],
                [s.slot for s in sessions[run]],
                new_ids[run],
                self.kv.scratch,
                self.graph_max_rows,
            )
            if self.graphs is not None:
                logits = self.graphs.replay_ragged(RaggedKey(t), *inputs)  # [max_rows, V]
            else:
                self.eager_passes += 1
                logits = self._forward.ragged(RaggedBatch(*(x.to(self.device) for x in inputs))).float()
            self.forward_passes += 1
            parts.append(logits[: run.stop - run.start])
        now = time.monotonic()
        for s, item in zip(sessions, new_ids):
            s.length += len(item)
            s.last_used = now
        batch = LastRows(parts[0] if len(parts) == 1 else torch.cat(parts), None)
        return [Extension.row(batch, i) for i in range(len(new_ids))]
