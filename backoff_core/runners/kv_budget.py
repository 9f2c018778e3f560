"""The KV budget of one model replica, in tokens (positions held across all its sessions).

One concept for both kinds of storage (types.KVSpec): static slots preallocated once
(static_runner.py, the GPU path) or per-session caches that count what they hold and
evict idle sessions (runner.py). A config may say `auto` for both choices; they are
resolved here, where the model is loaded (a replica knows its device, the CLI does not):
  - budget auto: on CUDA a fraction of the device memory free once the weights are loaded
    (times the replica's share of the GPU when models share one); on the CPU a fraction of
    the RAM available at start-up;
  - storage auto: static slots (with CUDA graphs) on CUDA, per-session caches on the CPU.
A token costs 2 (K and V) * layers * kv_heads * head_dim * bytes of the model's dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from backoff_core.types import KVSpec

GPU_FRACTION = 0.8  # of free device memory: CUDA graphs' pools and activations need the rest
RAM_FRACTION = 0.2  # of available RAM: several replicas (and their activations) share a node


def bytes_per_token(model) -> int:
    """KV bytes of one position of one session."""
    config = model.config
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    element = next(model.parameters()).element_size()
    return 2 * int(config.num_hidden_layers) * heads * head_dim * element


def available_ram() -> int:
    """Bytes of RAM available now (Linux: MemAvailable; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def auto_budget(model, gpu_share: float = 1.0) -> int:
    """The default budget in tokens for `model` on its device (see the module docstring)."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        import torch  # here, not at the top: Serve's app builder imports this module, runs no model

        free, _ = torch.cuda.mem_get_info(device)
        memory = free * GPU_FRACTION * min(1.0, max(gpu_share, 0.0) or 1.0)
    else:
        memory = available_ram() * RAM_FRACTION
    return max(1, int(memory // bytes_per_token(model)))


def resolve_kv(
    model,
    budget: int | Literal["auto"],
    max_len: int,
    static: bool | Literal["auto"] = "auto",
    cuda_graphs: bool = True,
    gpu_share: float = 1.0,
    reserve_tokens: int = 0,
    ragged: str = "auto",
    compile: str = "auto",
) -> KVSpec:
    """The KVSpec a replica runs with: `auto` resolved for this model on its device.
    reserve_tokens: positions kept elsewhere (the prefix cache) that `auto` leaves room for."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    use_static = on_cuda if static == "auto" else bool(static)
    tokens = max(1, auto_budget(model, gpu_share) - reserve_tokens) if budget == "auto" else int(budget)
    if use_static and budget == "auto":
        tokens = max(max_len, tokens - tokens % max_len)  # whole slots
    return KVSpec(tokens, max_len, cuda_graphs, use_static, ragged, compile)


def describe(kv: KVSpec, model) -> str:
    """One line for the replica's log: the resolved budget and what it costs."""
    kind = f"static slots of {kv.max_len}" if kv.static else "per-session caches"
    gib = kv.budget_tokens * bytes_per_token(model) / 2**30
    return f"KV budget {kv.budget_tokens} tokens ({gib:.2f} GiB, {kind})"


def kv_tokens(runner) -> int:
    """Positions a runner holds against its budget: per-session caches count their positions,
    static storage the whole slots taken."""
    static = getattr(runner, "kv", None)
    if static is not None and hasattr(static, "free_slots"):
        return (static.slots - static.free_slots) * static.max_len
    return int(getattr(runner, "kv_tokens", 0))


def kv_evictions(runner) -> int:
    """Idle sessions a runner evicted to make room (M_L: per-session caches or static slots)."""
    return int(getattr(runner, "evictions", 0))


@dataclass(frozen=True)
class Resolved:
    """What a replica's `auto` settings became for one model, as its info() reports them."""

    device: str  # "cuda:0", "cpu"
    dtype: str  # "bfloat16"
    static_kv: bool  # preallocated slots (StaticRunner), else per-session caches
    kv_budget_tokens: int
    kv_max_len: int | None  # positions a static slot holds (None: per-session caches)
    cuda_graphs: int  # padded graphs captured (0: eager forwards)
    ragged_graphs: int  # M_L's ragged catch-up graphs (static_ragged.py)
    ragged: bool  # catch-ups may run ragged now (`auto`: where their replays were timed faster)
    compiled_layers: bool  # decoder layers compiled by inductor (static_compiled.py)


def resolved(runner, kv: KVSpec) -> Resolved:
    """The runner's resolved storage, graphs and layers (a tensor-parallel runner's rank 0)."""
    runner = runner.runner if hasattr(runner, "comm") else runner  # TensorParallelRunner: rank 0's
    static = getattr(runner, "kv", None)
    graphs = getattr(getattr(runner, "graphs", None), "ms", None) or {}
    ragged = sum(type(key).__name__ == "RaggedKey" for key in graphs)
    forward = getattr(runner, "_forward", None)
    dtype = next(runner.model.parameters()).dtype
    return Resolved(
        device=str(getattr(runner, "device", "cpu")),
        dtype=str(dtype).removeprefix("torch."),
        static_kv=hasattr(static, "free_slots"),
        kv_budget_tokens=kv.budget_tokens,
        kv_max_len=static.max_len if hasattr(static, "free_slots") else None,
        cuda_graphs=len(graphs) - ragged,
        ragged_graphs=ragged,
        ragged=bool(getattr(runner, "ragged", False)),
        compiled_layers=getattr(forward, "compiled", None) is not None,
    )
