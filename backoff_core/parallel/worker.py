"""One tensor-parallel rank: its process group, its runner, and what runs the messages rank 0
sends (ranks.py drives it): `RankServer`, whatever carries the messages (a pipe to a process
of torch.multiprocessing: `serve_rank`; a Ray actor's calls: deployments/rank_actors.py).
Imports the runners only, never the engine, so a rank process starts with what it needs."""

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
    device: str = (
        "cpu"  # "cuda": rank r on cuda:r (its process sees the node's GPUs); "cuda:K": every rank on its cuda:K
    )
    cpu_kernels: str = "mkldnn"
    threads: int = 1  # torch threads a rank computes on
    timeout_s: float = 60.0  # a collective or an answer that takes longer breaks the group
    head: str = "vocab"  # the LM head's split (sharding.py): "vocab", or "rank0" (measured alternative)

    def rank_device(self, rank: int) -> str:
        return f"cuda:{rank}" if self.device == "cuda" else self.device


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


class RankServer:
    """Rank r >= 1's side: each message from rank 0, a (method, args, kwargs) tuple, gets one
    answer, ("ready" | "ok", None) or ("error", the exception's type name); "stop" gets none.
    First "shard" (its Packed shard), then "start" (join the group, build the runner: every
    rank at once, as the group forms), then the runner's calls."""

    def __init__(self, spec: RankSpec, port: int) -> None:
        torch.set_num_threads(spec.threads)
        from backoff_core.runners.factory import make_runner  # noqa: F401 - imported before the group forms

        self.spec, self.port = spec, port
        self.piece: Shard | None = None
        self.comm: Collectives | None = None
        self.runner = None

    def handle(self, message: tuple) -> tuple[str, object] | None:
        method, args, kwargs = message
        if method == "stop":
            return None
        if method == "shard":
            self.piece = args[0].unpack()
            return ("ready", None)
        if method == "start":
            self.comm = Collectives(group(self.spec, self.piece.rank, self.port), self.piece.rank, self.spec.size)
            self.runner = runner(self.spec, self.piece, self.comm)
            self.piece = None
            return ("ready", None)
        if method == "chaos_exit":  # tests: die at the n-th collective from now
            self.comm.exit_after = args[0]
            return ("ok", None)
        try:
            with torch.inference_mode():
                getattr(self.runner, method)(*args, **kwargs)
            return ("ok", None)
        except Exception as exc:  # noqa: BLE001 - rank 0 raises the same one, or the group is broken
            return ("error", type(exc).__name__)


def serve_rank(spec: RankSpec, port: int, conn) -> None:
    """A rank process of torch.multiprocessing: its pipe's messages to a RankServer until "stop"."""
    server = RankServer(spec, port)
    while (answer := server.handle(conn.recv())) is not None:
        conn.send(answer)
