"""CUDA graphs of the static forward, one per bucket, captured at load and replayed.

A graph replays fixed kernels on fixed addresses, so every input lives in a static buffer
allocated once (ids, positions, slots, last columns: [max_rows * max_k] flat, viewed per
bucket) and every output is copied, inside the graph, into one static output buffer. That
makes the graphs' own memory pure scratch, so all of them share one memory pool
(`graph_pool_handle`) without any graph's output being overwritten by another's
intermediates; captures go largest first so smaller graphs reuse its blocks (the vLLM
recipe). Replay = copy the inputs in, `graph.replay()`, copy the outputs out.

Uploads: the inputs are laid out in ONE device buffer `inputs` (ids | positions | slots |
last_col | token_slots, the last for ragged forwards: static_ragged.py), mirrored by one
pinned host buffer; a step writes its inputs into the
pinned mirror and moves them with one asynchronous copy. Before the host writes the mirror
again it waits on the event of the last copy (which has long finished by then: the step
read its tokens back in between), so a copy in flight is never overwritten.

The forward writes K/V into the storage inside the graph (index_put at [slot, position]),
so a replay extends the sessions in place, as the eager forward does. Capture runs every
token at the scratch column, so capturing never disturbs a live session.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from backoff_core.runners.graph_plan import GraphKey
from backoff_core.runners.ragged_reads import far_layout, key_blocks_read
from backoff_core.runners.static_forward import Batch, StaticForward
from backoff_core.runners.static_ragged import RaggedBatch, RaggedKey, block_size

__all__ = ["CudaGraphs", "GraphKey"]


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
        self.n = n
        # ids [n] | positions [n] | slots [max_rows] | last_col [max_rows] | token_slots [n], one upload
        self.inputs = torch.zeros(3 * n + 2 * max_rows, dtype=torch.long, device=dev)
        self.ids, self.positions = self.inputs[:n], self.inputs[n : 2 * n]
        self.slots, self.last_col = (
            self.inputs[2 * n : 2 * n + max_rows],
            self.inputs[2 * n + max_rows : 2 * (n + max_rows)],
        )
        self.token_slots = self.inputs[2 * (n + max_rows) :]  # a ragged forward's slot of each token
        self.positions.fill_(kv.scratch)
        self.staging = torch.zeros(self.inputs.shape, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._uploaded = torch.cuda.Event() if dev.type == "cuda" else None
        self.uploads = 0  # host-to-device input copies (one per forward that fits the buffers)
        dtype = kv.keys[0].dtype
        self.logits = torch.zeros(n * self.vocab, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n * self.width, dtype=dtype, device=dev)
        self.pool = None  # one memory pool shared by every graph (created at the first capture)
        self._side = None  # the side stream of the warm-up runs
        self._graphs: dict[GraphKey | RaggedKey, torch.cuda.CUDAGraph] = {}
        self.ms: dict[GraphKey | RaggedKey, float] = {}  # each graph's replay time (time_replays), for layouts
        # a ragged graph's replay on inputs that read far (far_layout): (the most key blocks a
        # query block read there, ms); its `ms` read one block a query block
        self.far: dict[RaggedKey, tuple[int, float]] = {}

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def fits(self, key: GraphKey | RaggedKey) -> bool:
        if isinstance(key, RaggedKey):
            return key.tokens <= self.n
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

    def _ragged_batch(self, key: RaggedKey) -> RaggedBatch:
        t = key.tokens
        return RaggedBatch(self.ids[:t], self.positions[:t], self.token_slots[:t], self.last_col)

    def _outputs(self, key: GraphKey | RaggedKey) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(key, RaggedKey):  # every row's last logits: [max_rows, 1, V]
            return self.logits[: self.max_rows * self.vocab].view(self.max_rows, 1, self.vocab), self.hidden[:0]
        k_out = 1 if key.last_only else key.k
        logits = self.logits[: key.rows * k_out * self.vocab].view(key.rows, k_out, self.vocab)
        hidden = self.hidden[: key.rows * key.k * self.width].view(key.rows, key.k, self.width)
        return logits, hidden

    def _body(self, key: GraphKey | RaggedKey) -> None:
        if isinstance(key, RaggedKey):
            self._outputs(key)[0].copy_(self.forward.ragged(self._ragged_batch(key))[:, None])
            return
        logits, hidden = self.forward(self._batch(key))
        out_logits, out_hidden = self._outputs(key)
        out_logits.copy_(logits)
        if hidden is not None:
            out_hidden.copy_(hidden)

    # -- capture / replay ----------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, keys: list[GraphKey | RaggedKey], progress: bool = True) -> float:
        """Capture every key not yet captured (largest first); returns the seconds taken."""
        todo = sorted({k for k in keys if k not in self._graphs and self.fits(k)}, key=lambda k: -k.size)
        start = time.perf_counter()
        for key in tqdm(todo, desc=f"{self.forward.kv.name}: capturing CUDA graphs", disable=not progress):
            self._harmless(key)
            self._graphs[key] = self._record(key)
        if self.ids.is_cuda:
            torch.cuda.synchronize()
        self.positions.fill_(self.forward.kv.scratch)  # the graphs' padding stays harmless
        return time.perf_counter() - start

    def _harmless(self, key: GraphKey | RaggedKey) -> None:
        """Inputs that write and read nothing of a session: every token at the scratch column;
        a dense view's rows are its slots, a gathered (or ragged) forward's rows all slot 0.
        A gathered forward has up to next_power_of_two(slots) rows, so a dense view's slot ids
        left in the buffer would gather past the storage (on a GPU: a device-side assert)."""
        self.positions.fill_(self.forward.kv.scratch)
        self.token_slots.zero_()
        if getattr(key, "dense", False):
            self.slots.copy_(torch.arange(self.max_rows, device=self.slots.device))
        else:
            self.slots.zero_()
        self.last_col.zero_()

    def _record(self, key: GraphKey | RaggedKey) -> torch.cuda.CUDAGraph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self._side = torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):  # warm-up outside the graph: lazy inits, kernel choice
            self._body(key)
        torch.cuda.current_stream().wait_stream(self._side)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._body(key)
        except BaseException:
            # where the body broke the capture, torch.cuda.graph's __exit__ raises from
            # capture_end before it restores the stream: restore it here, so that what runs
            # next (the padded path, where a ragged capture fails: static_ragged._warm_ragged)
            # runs on the stream it ran on, not on the abandoned capture's
            torch.cuda.set_stream(stream)
            raise
        return graph

    def forget(self, keys: list[GraphKey | RaggedKey]) -> None:
        """Drop these graphs and their times (a set whose capture failed part way)."""
        for key in keys:
            self._graphs.pop(key, None)
            self.ms.pop(key, None)
            self.far.pop(key, None)

    def time_replays(self, keys: list[GraphKey | RaggedKey], free: Sequence[int] = ()) -> float:
        """Time every captured graph of `keys` into `ms` (static_layout.choose weighs the
        layouts of an extend by them), and with `free` slots (no session's: a ragged graph
        timed far writes a column of them) each ragged graph again on far inputs into `far`;
        returns the seconds taken."""
        start = time.perf_counter()
        kv = self.forward.kv
        for key in keys:
            if key in self._graphs and key not in self.ms:
                self.ms[key] = self.replay_ms(key)
            if free and isinstance(key, RaggedKey) and key in self._graphs and key not in self.far:
                positions, slots = far_layout(key.tokens, free, kv.max_len)
                read = key_blocks_read(positions, slots, self.forward.groups, block_size(kv.max_len))
                self.far[key] = (read, self.replay_ms(key, far=free))
                self._harmless(key)  # the graphs' padding stays harmless
        return time.perf_counter() - start

    @torch.inference_mode()
    def replay_ms(self, key: GraphKey | RaggedKey, repeats: int = 3, far: Sequence[int] | None = None) -> float:
        """The median GPU time of one replay of a captured graph (CUDA events; a replay
        first, untimed), on the harmless inputs it was captured on, or a ragged graph's with
        its tokens laid out far over the `far` slots (ragged_reads.far_layout: slots no
        session holds). At load (time_replays), never during a step."""
        self._harmless(key)
        if far is not None:
            positions, slots = far_layout(key.tokens, far, self.forward.kv.max_len)
            self.positions[: key.tokens].copy_(torch.from_numpy(positions))
            self.token_slots[: key.tokens].copy_(torch.from_numpy(slots))
        graph = self._graphs[key]
        graph.replay()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    def upload(self, ids, positions, slots, last_col, token_slots=None) -> Batch:
        """Host inputs (ids, positions: [rows, k]; slots, last_col: [rows]; a ragged forward's
        token_slots: [rows * k]) -> the static device buffers viewed at those shapes, in one
        copy from the pinned mirror."""
        rows, k = ids.shape
        n, m = self.n, self.max_rows
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous copy out of the mirror is done
        host = self.staging
        host[: rows * k].copy_(ids.reshape(-1))
        host[n : n + rows * k].copy_(positions.reshape(-1))
        host[2 * n : 2 * n + len(slots)].copy_(slots)
        host[2 * n + m : 2 * n + m + len(last_col)].copy_(last_col)
        if token_slots is not None:
            host[2 * (n + m) : 2 * (n + m) + rows * k].copy_(token_slots)
        self.inputs.copy_(host, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        self.uploads += 1
        return Batch(
            input_ids=self.ids[: rows * k].view(rows, k),
            positions=self.positions[: rows * k].view(rows, k),
            slots=self.slots[:rows],
            last_col=self.last_col[:rows],
            length=0,
            dense=False,
            last_only=False,
            hidden_layer=None,
        )

    def replay(
        self, key: GraphKey, ids, positions, slots, last_col, before: Callable[[Batch], None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions: [rows, k] and slots, last_col: [rows] (host tensors); before: given
        the uploaded buffers, queued ahead of the replay (ids drawn on the device go in).
        Returns copies (float32 logits; hidden in the model's dtype) that the next replay
        cannot overwrite."""
        batch = self.upload(ids, positions, slots, last_col)
        if before is not None:
            before(batch)
        self._graphs[key].replay()
        logits, hidden = self._outputs(key)
        logits = logits.to(torch.float32, copy=True)
        return logits, (hidden.clone() if key.hidden_layer is not None else None)

    def replay_ragged(self, key: RaggedKey, ids, positions, token_slots, last) -> torch.Tensor:
        """A ragged forward (host tensors: ids, positions, token_slots [tokens]; last
        [max_rows]) -> float32 logits [max_rows, V], a copy."""
        t = key.tokens
        self.upload(ids.view(1, t), positions.view(1, t), ids[:0], last, token_slots)
        self._graphs[key].replay()
        return self._outputs(key)[0][:, 0].to(torch.float32, copy=True)
