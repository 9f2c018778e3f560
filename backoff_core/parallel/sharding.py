"""Megatron-style tensor parallelism of a Llama-family HF model: one rank's shard.

Each of N ranks holds 1/N of every layer's attention heads and MLP columns:
  - q/k/v and gate/up split by columns (their output features): no communication;
  - o_proj and down_proj split by rows (their input features), each followed by ONE
    all-reduce (sum) of its [B, K, d] output (RowParallel): two a layer;
  - the KV heads split with the query heads that read them (GQA groups stay whole), or,
    where N exceeds the KV heads, each KV head replicated on the N / kv_heads ranks whose
    query heads read it (vLLM's rule); any other N is refused at start-up, naming the model
    and its head counts (layout);
  - the LM head split by vocabulary (VocabParallelHead): each rank multiplies by its
    ceil(V/N) rows and rank 0 gathers the [.., V] logits (one gather a forward); the
    embedding and the norms are replicated. head="rank0", the alternative measured by
    benchmarks/tensor_parallel.py: the whole head on rank 0, which alone needs logits (the
    other ranks skip it: SkippedHead), no gather.
Why the vocabulary split and not a replicated head: on a GPU the head is bound by its weight's
bytes (2.1 GB of Llama-3.1-70B's in bf16, a quarter of a TP=4 rank's layer bytes), and a
replicated head computed on rank 0 alone makes rank 0 the straggler of every step; split, it
costs each rank 1/N and one gather of the logits (vLLM's ParallelLMHead does the same).

The shard is an ordinary HF model built from a config with the rank's head counts
(`num_attention_heads` = H/N, `num_key_value_heads` = its KV heads, `head_dim` kept,
`intermediate_size` = I/N), so every runner (per-session DynamicCaches, static KV slots,
the prefix cache) sizes its KV storage per rank from the config without knowing of TP.
This is our own sharding, not transformers' `tp_plan` (which does run on CPU gloo with torch
2.13): that needs the process's default process group, so one process cannot hold M_S's and
M_L's groups at once, its weights are DTensors the oneDNN kernels and the static runner's
fused projections do not take, and it has no KV-head replication (docs/tensor-parallel.md).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")  # LlamaModel's layer names and forward
_COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


@dataclass(frozen=True)
class HeadLayout:
    """How N ranks split one model's heads."""

    size: int  # N ranks
    heads: int  # H query heads of the whole model
    kv_heads: int  # KV heads of the whole model
    head_dim: int
    intermediate: int  # I, the MLP's width

    @property
    def heads_per_rank(self) -> int:
        return self.heads // self.size

    @property
    def kv_per_rank(self) -> int:
        return max(1, self.kv_heads // self.size)  # 1 where N > kv_heads (replicated)

    def kv_head_range(self, rank: int) -> tuple[int, int]:
        """The KV heads rank `rank` holds: its query heads' groups, or one replicated head."""
        if self.kv_heads >= self.size:
            return rank * self.kv_per_rank, (rank + 1) * self.kv_per_rank
        head = rank // (self.size // self.kv_heads)
        return head, head + 1


def valid_sizes(heads: int, kv_heads: int, intermediate: int) -> list[int]:
    return [n for n in range(1, heads + 1) if _fits(n, heads, kv_heads, intermediate)]


def _fits(n: int, heads: int, kv_heads: int, intermediate: int) -> bool:
    return heads % n == 0 and intermediate % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)


def layout(config, name: str, size: int) -> HeadLayout:
    """The split of `config`'s heads over `size` ranks; ValueError naming the model, its head
    counts and the sizes that work, for an architecture or size that cannot be split."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"{name}: tensor parallelism supports {SUPPORTED_TYPES}, not model_type={kind!r}")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    inter = int(config.intermediate_size)
    if size < 1 or not _fits(size, heads, kv_heads, inter):
        raise ValueError(
            f"{name} ({_identity(config)}): tensor_parallel={size} cannot split its {heads} attention heads and {kv_heads} KV heads "
            f"(MLP width {inter}): the size must divide the heads and the MLP width, and divide the KV heads "
            f"or be a multiple of them; sizes that work: {valid_sizes(heads, kv_heads, inter)}"
        )
    return HeadLayout(size, heads, kv_heads, head_dim, inter)


def _identity(config) -> str:
    """The model as a user named it (a hub id; not a cache path) and its shape."""
    named = str(getattr(config, "_name_or_path", "") or "")
    shape = f"{config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}"
    return f"{named}: {shape}" if named and not named.startswith("/") else shape


class Collectives:
    """The rank's process group and what its collectives cost (seconds, calls): the
    all-reduce share a benchmark reports. Works on a bare ProcessGroupGloo / NCCL object,
    not the process's default group, so one process may drive several models' groups."""

    def __init__(self, group, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.seconds = 0.0
        self.calls = 0
        self.exit_after: int | None = None  # chaos: this rank exits at its n-th collective (ranks.py)

    def _timed(self, work) -> None:
        self._chaos()
        start = time.perf_counter()
        work().wait()
        self.seconds += time.perf_counter() - start
        self.calls += 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        self._timed(lambda: self.group.allreduce([t]))
        return t

    def gather_last_dim(self, t: torch.Tensor, width: int) -> torch.Tensor:
        """[..., w] from each rank -> [..., width] (the ranks' pieces side by side, trimmed)
        on rank 0; other ranks get an uninitialised tensor of that shape (never read)."""
        t = t.contiguous()
        outs = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == 0 else []
        self._timed(lambda: self.group.gather(outs, [t], _gather_options()))
        if self.rank != 0:
            return t.new_empty(*t.shape[:-1], width)
        return torch.cat(outs[0], dim=-1)[..., :width]

    def _chaos(self) -> None:
        if self.exit_after is not None:
            self.exit_after -= 1
            if self.exit_after <= 0:
                import os

                os._exit(17)  # a rank dying mid-forward (tests: a killed rank fails the catch-up)


def _gather_options():
    opts = torch.distributed.GatherOptions()
    opts.rootRank = 0
    return opts


class RowParallel(nn.Module):
    """A linear split by its input features (o_proj, down_proj): this rank's partial
    product, summed over the ranks by one all-reduce. The bias lives on rank 0 only."""

    def __init__(self, linear: nn.Module, comm: Collectives) -> None:
        super().__init__()
        self.linear = linear
        self.comm = comm

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, K, in/N] -> [B, K, out]
        return self.comm.all_reduce(self.linear(x))


class SkippedHead(nn.Module):
    """head="rank0" on ranks 1..N-1: no head; an uninitialised [.., V] (never read)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self._shape = torch.empty(vocab, hidden, device="meta")

    @property
    def weight(self) -> torch.Tensor:
        return self._shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], self._shape.shape[0])


class VocabParallelHead(nn.Module):
    """The LM head split by vocabulary rows: [B, K, d] -> [B, K, V] logits on rank 0."""

    def __init__(self, linear: nn.Module, vocab: int, comm: Collectives) -> None:
        super().__init__()
        self.linear = linear
        self.vocab = vocab
        self.comm = comm
        self._shape = torch.empty(vocab, int(linear.weight.shape[1]), device="meta")

    @property
    def weight(self) -> torch.Tensor:  # what get_output_embeddings().weight.shape reads: [V, d]
        return self._shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.gather_last_dim(self.linear(x), self.vocab)


@dataclass(frozen=True)
class Shard:
    """What a rank needs to build its part of the model: a config with the rank's head
    counts and its tensors (CPU; shared memory when they cross to a rank process)."""

    rank: int
    layout: HeadLayout
    vocab: int
    config: object  # transformers PretrainedConfig of the shard
    state: dict[str, torch.Tensor]
    head: str = "vocab"  # "vocab": split by vocabulary; "rank0": whole on rank 0, skipped elsewhere

    def packed(self) -> "Packed":
        """For the pipe to a rank process: the tensors as one flat buffer per dtype, so that
        crossing in shared memory takes one file descriptor per dtype, not one per tensor (an
        80-layer model has ~720 tensors a rank; many systems limit a process to 1024 descriptors)."""
        flats, index = {}, []
        for dtype in sorted({t.dtype for t in self.state.values()}, key=str):
            names = [k for k, t in self.state.items() if t.dtype == dtype]
            flats[dtype] = torch.cat([self.state[k].reshape(-1) for k in names])
            offset = 0
            for k in names:
                index.append((k, dtype, offset, tuple(self.state[k].shape)))
                offset += self.state[k].numel()
        return Packed(self.rank, self.layout, self.vocab, self.config, flats, tuple(index), self.head)


@dataclass(frozen=True)
class Packed:
    """A Shard as one buffer per dtype and where each tensor lies in it."""

    rank: int
    layout: HeadLayout
    vocab: int
    config: object
    flats: dict[torch.dtype, torch.Tensor]
    index: tuple[tuple[str, torch.dtype, int, tuple[int, ...]], ...]  # (name, dtype, offset, shape)
    head: str

    def unpack(self) -> Shard:
        state = {k: self.flats[d][o : o + math.prod(s)].view(s) for k, d, o, s in self.index}
        return Shard(self.rank, self.layout, self.vocab, self.config, state, self.head)


HEADS = ("vocab", "rank0")


def shards(model, name: str, size: int, head: str = "vocab") -> Iterator[Shard]:
    """Each rank's shard of a model (dense, or on oneDNN kernels: kernels.py), rank 0 first,
    one at a time: the caller sends each on before the next is cut (peak: the model and the
    shards not yet received)."""
    from backoff_core.models.kernels import dense_state_dict

    lay = layout(model.config, name, size)
    if head not in HEADS:
        raise ValueError(f"{name}: unknown LM head split {head!r}; choose one of {HEADS}")
    vocab = int(model.get_output_embeddings().weight.shape[0])
    dense = dense_state_dict(model)  # once: on oneDNN kernels, the dense copies
    dense.setdefault("lm_head.weight", dense["model.embed_tokens.weight"])  # tied: the head gets its own rows
    config = _shard_config(model.config, lay)
    for rank in range(size):
        yield Shard(rank, lay, vocab, config, _state(dense, lay, rank, vocab, head), head)


def shard(model, name: str, rank: int, size: int, head: str = "vocab") -> Shard:
    """Rank `rank`'s shard alone (tests, plans)."""
    return next(s for s in shards(model, name, size, head) if s.rank == rank)


def _state(dense: dict[str, torch.Tensor], lay: HeadLayout, rank: int, vocab: int, head: str) -> dict:
    if head == "vocab":
        return {k: _piece(k, v, lay, rank, vocab) for k, v in dense.items()}
    whole = dense["lm_head.weight"]  # "rank0": rank 0 holds it all, the others a placeholder row
    state = {k: _piece(k, v, lay, rank, vocab) for k, v in dense.items() if k != "lm_head.weight"}
    state["lm_head.weight"] = whole.detach().clone() if rank == 0 else whole.new_zeros(1, whole.shape[1])
    return state


def _shard_config(config, lay: HeadLayout):
    cfg = copy.deepcopy(config)
    cfg.num_attention_heads = lay.heads_per_rank
    cfg.num_key_value_heads = lay.kv_per_rank
    cfg.head_dim = lay.head_dim
    cfg.intermediate_size = lay.intermediate // lay.size
    cfg.tie_word_embeddings = False  # the head holds its vocabulary rows; the embedding all of them
    cfg.tensor_parallel = lay.size
    return cfg


def _piece(key: str, t: torch.Tensor, lay: HeadLayout, rank: int, vocab: int) -> torch.Tensor:
    """This rank's part of one tensor of the state dict (a contiguous copy)."""
    t = t.detach()
    d, n = lay.head_dim, lay.size
    if key.startswith("lm_head."):  # [V, d] -> [ceil(V/N), d], the last rank's padded with zeros
        rows = math.ceil(vocab / n)
        out = t.new_zeros(rows, *t.shape[1:])
        part = t[rank * rows : (rank + 1) * rows]
        out[: part.shape[0]] = part
        return out
    col = next((c for c in _COLUMNS if f".{c}." in key), None)
    if col is not None:  # split the output features (weight rows, bias)
        if col.endswith(("k_proj", "v_proj")):
            lo, hi = lay.kv_head_range(rank)
            return t[lo * d : hi * d].clone()
        width = t.shape[0] // n
        return t[rank * width : (rank + 1) * width].clone()
    if key.endswith(("o_proj.weight", "down_proj.weight")):  # split the input features
        width = t.shape[1] // n
        return t[:, rank * width : (rank + 1) * width].clone()
    if key.endswith(("o_proj.bias", "down_proj.bias")):
        return t.clone() if rank == 0 else torch.zeros_like(t)  # added once, by rank 0
    return t.clone()  # embedding, norms: replicated


def build(piece: Shard, comm: Collectives, dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """The rank's model (eval mode): an HF model of the shard's config with its tensors, its
    row-split linears and LM head wrapped to communicate over `comm`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(piece.config, dtype=dtype)
    head = piece.state["lm_head.weight"]  # [ceil(V/N), d]
    model.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False, dtype=dtype)
    model.load_state_dict(piece.state, strict=True)
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, comm)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, comm)
    if piece.head == "vocab":
        model.lm_head = VocabParallelHead(model.lm_head, piece.vocab, comm)
    elif piece.rank != 0:
        model.lm_head = SkippedHead(piece.vocab, int(head.shape[1]))
    return model.to(device).eval()
