"""CUDA graphs of the static forward, one per bucket, captured at load and replayed.

A graph replays fixed kernels on fixed addresses, so every input lives in a static buffer
allocated once (ids, positions, slots, last columns: [max_rows * max_k] flat, viewed per
bucket) and every output is copied, inside the graph, into one static output buffer. That
makes the graphs' own memory pure scratch, so all of them share one memory pool
(`graph_pool_handle`) without any graph's output being overwritten by another's
intermediates; captures go largest first so smaller graphs reuse its blocks (the vLLM
recipe). Replay = copy the inputs in, `graph.replay()`, copy the outputs out.

The forward writes K/V into the storage inside the graph (index_put at [slot, position]),
so a replay extends the sessions in place, as the eager forward does. Capture runs every
token at the scratch column, so capturing never disturbs a live session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from backoff_core.runners.static_forward import Batch, StaticForward


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


class CudaGraphs:
    """The captured graphs of one StaticForward and their static buffers."""

    def __init__(self, forward: StaticForward, max_rows: int, max_k: int) -> None:
        kv = forward.kv
        dev = kv.keys[0].device
        model = forward.model
        self.forward = forward
        self.max_rows, self.max_k = max_rows, max_k
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        self.width = int(model.config.hidden_size)
        n = max_rows * max_k
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.full((n,), kv.scratch, dtype=torch.long, device=dev)
        self.slots = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.last_col = torch.zeros(max_rows, dtype=torch.long, device=dev)
        dtype = kv.keys[0].dtype
        self.logits = torch.zeros(n * self.vocab, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n * self.width, dtype=dtype, device=dev)
        self.pool = None  # one memory pool shared by every graph (created at the first capture)
        self._side = None  # the side stream of the warm-up runs
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def fits(self, key: GraphKey) -> bool:
        return key.rows <= self.max_rows and key.k <= self.max_k

    # -- static buffers ------------------------------------------------------------------
    def _batch(self, key: GraphKey) -> Batch:
        n = key.rows * key.k
        return Batch(
            input_ids=self.ids[:n].view(key.rows, key.k),
            positions=self.positions[:n].view(key.rows, key.k),
            slots=self.slots[: key.rows],
            last_col=self.last_col[: key.rows],
            length=key.length,
            dense=key.dense,
            last_only=key.last_only,
            hidden_layer=key.hidden_layer,
        )

    def _outputs(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        k_out = 1 if key.last_only else key.k
        logits = self.logits[: key.rows * k_out * self.vocab].view(key.rows, k_out, self.vocab)
        hidden = self.hidden[: key.rows * key.k * self.width].view(key.rows, key.k, self.width)
        return logits, hidden

    def _body(self, key: GraphKey) -> None:
        logits, hidden = self.forward(self._batch(key))
        out_logits, out_hidden = self._outputs(key)
        out_logits.copy_(logits)
        if hidden is not None:
            out_hidden.copy_(hidden)

    # -- capture / replay ----------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, keys: list[GraphKey], progress: bool = True) -> float:
        """Capture every key not yet captured (largest first); returns the seconds taken."""
        todo = sorted({k for k in keys if k not in self._graphs and self.fits(k)}, key=lambda k: -k.size)
        start = time.perf_counter()
        for key in tqdm(todo, desc=f"{self.forward.kv.name}: capturing CUDA graphs", disable=not progress):
            # harmless inputs: every token at the scratch column; dense rows are their slots
            self.positions.fill_(self.forward.kv.scratch)
            if key.dense:
                self.slots.copy_(torch.arange(self.max_rows, device=self.slots.device))
            else:
                self.slots.zero_()
            self.last_col.zero_()
            self._graphs[key] = self._record(key)
        if self.ids.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def _record(self, key: GraphKey) -> torch.cuda.CUDAGraph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self._side = torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):  # warm-up outside the graph: lazy inits, kernel choice
            self._body(key)
        torch.cuda.current_stream().wait_stream(self._side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._body(key)
        return graph

    def replay(self, key: GraphKey, ids, positions, slots, last_col) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions: [rows, k] and slots, last_col: [rows] (host or device tensors).
        Returns copies (float32 logits; hidden in the model's dtype) that the next replay
        cannot overwrite."""
        n = key.rows * key.k
        self.ids[:n].copy_(ids.reshape(-1), non_blocking=True)
        self.positions[:n].copy_(positions.reshape(-1), non_blocking=True)
        self.slots[: key.rows].copy_(slots, non_blocking=True)
        self.last_col[: key.rows].copy_(last_col, non_blocking=True)
        self._graphs[key].replay()
        logits, hidden = self._outputs(key)
        logits = logits.to(torch.float32, copy=True)
        return logits, (hidden.clone() if key.hidden_layer is not None else None)
