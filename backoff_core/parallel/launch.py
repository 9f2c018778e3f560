"""How ranks 1..N-1 are started and reached: a `Launcher` starts them and returns one
`RankLink` each, the channel rank 0 (ranks.py) sends its messages on and reads each rank's
answers from. Here: processes of torch.multiprocessing (spawn) over pipes, the default, for
`backoff generate` and any caller without a cluster. In Ray Serve the LargeModel replica
injects its own launcher (deployments/rank_actors.py): Ray actors in the replica's placement
group. Either way the collectives are torch.distributed's, over a TCPStore that rank 0 hosts
on loopback: every rank runs on rank 0's node."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch.multiprocessing as mp

from backoff_core.parallel.worker import RankSpec, serve_rank


class RankLink(Protocol):
    """Rank r >= 1 as rank 0 reaches it: messages in order, one answer per message (worker.py
    RankServer). recv raises EOFError or OSError once the rank is gone."""

    pid: int  # the rank's process, on rank 0's node (tests kill it)
    node: str  # where it runs ("": rank 0's process's node, not a cluster's)

    def send(self, message: tuple) -> None: ...

    def poll(self, timeout_s: float) -> bool: ...  # an answer (or the rank's death) is ready

    def recv(self) -> tuple: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def join(self, timeout_s: float) -> None: ...  # after "stop": gone within timeout_s, else killed


Launcher = Callable[[RankSpec, int], list[RankLink]]  # (spec, rank 0's store port) -> ranks 1..N-1


class ProcessLink:
    """A rank process of torch.multiprocessing and its pipe."""

    node = ""

    def __init__(self, conn, proc) -> None:
        self.conn, self.proc, self.pid = conn, proc, proc.pid

    def send(self, message: tuple) -> None:
        self.conn.send(message)

    def poll(self, timeout_s: float) -> bool:
        return self.conn.poll(timeout_s)

    def recv(self) -> tuple:
        return self.conn.recv()

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()

    def join(self, timeout_s: float) -> None:
        self.proc.join(timeout=timeout_s)
        self.kill()


def spawn_ranks(spec: RankSpec, port: int) -> list[RankLink]:
    """Ranks 1..N-1 as children of this process (spawn: a fresh interpreter each)."""
    ctx = mp.get_context("spawn")
    links: list[RankLink] = []
    for _ in range(1, spec.size):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=serve_rank, args=(spec, port, there), daemon=True)
        proc.start()
        links.append(ProcessLink(here, proc))
    return links
