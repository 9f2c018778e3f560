"""One tensor-parallel rank: its process group, its runner, and the loop that runs the
calls rank 0 sends (ranks.py drives it). Imports the runners only, never the engine, so a
rank process starts with what it needs."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, replace

import torch

from backoff_core.parallel.sharding import Collectives, Shard, build
from backoff_core.types import KVSpec, PrefixCacheSpec


@dataclass(frozen=True)
class RankSpec:
    """How every rank builds its runner (make_runner's arguments) and its device."""

    name: str
    size: int
    kv: KVSpec | None = None
    small: bool = False
    classifier_path: str | None = None
    prefix_cache: PrefixCacheSpec | None = PrefixCacheSpec()
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # "cuda": rank r on cuda:r (its process sees the node's GPUs)
    cpu_kernels: str = "mkldnn"
    threads: int = 1  # torch threads a rank computes on
    timeout_s: float = 60.0  # a collective or an answer that takes longer breaks the group
    head: str = "vocab"  # the LM head's split (sharding.py): "vocab", or "rank0" (measured alternative)

    def rank_device(self, rank: int) -> str:
        return f"cuda:{rank}" if self.device.startswith("cuda") else self.device


def group(spec: RankSpec, rank: int, port: int):
    """The ranks' own process group over a TCPStore on loopback (rank 0 hosts it)."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = torch.distributed.TCPStore("127.0.0.1", port, spec.size, rank == 0, timeout=timeout)
    if spec.device.startswith("cuda"):
        return torch.distributed.ProcessGroupNCCL(store, rank, spec.size)
    return torch.distributed.ProcessGroupGloo(store, rank, spec.size, timeout)


def runner(spec: RankSpec, piece: Shard, comm: Collectives):
    from backoff_core.models.kernels import use_cpu_kernels
    from backoff_core.runners.factory import make_runner

    model = use_cpu_kernels(build(piece, comm, spec.dtype, spec.rank_device(piece.rank)), spec.cpu_kernels)
    kv = spec.kv if spec.kv is None else replace(spec.kv, ragged="off")  # a timed choice could differ by rank
    return make_runner(model, spec.name, kv, spec.small, spec.classifier_path, spec.prefix_cache)


def serve_rank(spec: RankSpec, port: int, conn) -> None:
    """Rank r >= 1: receive its shard, build the runner, then run each call rank 0 sends until
    told to stop."""
    torch.set_num_threads(spec.threads)
    from backoff_core.runners.factory import make_runner  # noqa: F401 - imported before the group forms

    piece: Shard = conn.recv().unpack()
    conn.send(("ready", None))
    comm = Collectives(group(spec, piece.rank, port), piece.rank, spec.size)
    rank_runner = runner(spec, piece, comm)
    del piece
    conn.send(("ready", None))
    while True:
        method, args, kwargs = conn.recv()
        if method == "stop":
            return
        if method == "chaos_exit":  # tests: die at the n-th collective from now
            comm.exit_after = args[0]
            conn.send(("ok", None))
            continue
        try:
            with torch.inference_mode():
                getattr(rank_runner, method)(*args, **kwargs)
            conn.send(("ok", None))
        except Exception as exc:  # noqa: BLE001 - rank 0 raises the same one, or the group is broken
            conn.send(("error", type(exc).__name__))
