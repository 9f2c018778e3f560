"""A model over N tensor-parallel ranks, driven as one runner (rank 0 in the caller's process).

Every rank runs the SAME runner (ModelRunner or StaticRunner, made by make_runner) over its
shard of the model (sharding.py): its KV storage, slots and prefix cache hold its own heads,
sized from the shard's config. Rank 0 is the runner the caller holds (the engine, the
LargeModel replica's batcher): each call that changes state (open, close, crop, extend,
adopt_prefix, warmup) is sent to ranks 1..N-1 over their links first and then run here, so the
ranks enter the forward's collectives together; every rank answers each call (ok, or the
error it raised) and rank 0 returns its own result. Reads (has, length, request_ids,
kv_tokens, prefix_stats, ...) are answered by rank 0 alone. Since the calls reach every rank
in one order and every decision that is not a function of them (TTLs, leases, which session
to evict) is taken on rank 0 and sent as a call, the ranks' tables stay identical.

Ranks 1..N-1 are started by a launcher (launch.py): processes of torch.multiprocessing
(spawn) by default, Ray actors in the replica's placement group when a LargeModel replica
injects its launcher (deployments/rank_actors.py). Either way they join a torch.distributed
process group of their own (gloo on the CPU; NCCL on CUDA devices), not the process's
default group: one process may drive M_S's ranks and M_L's.

Failure: a rank that dies (or hangs past `timeout_s`) breaks the group. The call in flight
raises RankFailure, a LargeUnavailable, so the engine degrades the requests of that catch-up
(M_S alone, or failed, per on_large_failure) exactly as for a lost LargeModel; every later
extend raises it at once, open / close / crop do nothing, and `healthy` turns False (the
LargeModel's health check then has Serve restart the replica as a whole). A dying peer
closes its sockets, so gloo fails the pending collective at once rather than at the timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import torch

from backoff_core.errors import RankFailure
from backoff_core.parallel.launch import Launcher, RankLink, spawn_ranks
from backoff_core.parallel.sharding import Collectives, layout, shards
from backoff_core.parallel.worker import RankSpec, group, runner
from backoff_core.runners.factory import make_runner
from backoff_core.types import KVSpec, PrefixCacheSpec

log = logging.getLogger(__name__)


class TensorParallelRunner:
    """The runner of rank 0, its calls mirrored on ranks 1..N-1 (module docstring)."""

    # ids reach the other ranks as host lists over their pipes: no extend(on_device=...), so
    # the engine never launches M_S's step ahead over a split model (engine/ahead.py)
    extends_on_device = False

    def __init__(self, model, spec: RankSpec, launch: Launcher = spawn_ranks) -> None:
        layout(model.config, spec.name, spec.size)  # refuse a size that cannot split the heads now
        self.spec = spec
        self.broken = ""  # why the group broke ("": it did not)
        self._lock = threading.RLock()
        port = _free_port()
        self.links: list[RankLink] = launch(spec, port)
        pieces = shards(model, spec.name, spec.size, spec.head)
        piece = next(pieces)  # rank 0's
        for link, other in zip(self.links, pieces):  # in shared memory (or Ray's store); held until received
            link.send(("shard", (other.packed(),), {}))
            del other
        self._answers("start-up")  # every rank has its shard (a broken import fails here, not at a timeout)
        for link in self.links:
            link.send(("start", (), {}))  # they join the group as rank 0 does
        self.comm = Collectives(group(spec, 0, port), 0, spec.size)
        self.runner = runner(spec, piece, self.comm)  # the ranks build theirs (and warm up) with it
        del piece
        self._answers("start-up")

    # -- reads: rank 0 answers ---------------------------------------------------------------
    def __getattr__(self, name: str):
        return getattr(self.__dict__["runner"], name)

    @property
    def healthy(self) -> bool:
        return not self.broken and all(link.is_alive() for link in self.links)

    def pids(self) -> list[int]:
        """The rank processes 1..N-1 (tests kill one)."""
        return [link.pid for link in self.links]

    # -- calls every rank runs ---------------------------------------------------------------
    def open(self, *args, **kwargs):
        return self._mirror("open", args, kwargs, quiet=True)

    def close(self, *args, **kwargs):
        return self._mirror("close", args, kwargs, quiet=True)

    def crop(self, *args, **kwargs):
        return self._mirror("crop", args, kwargs, quiet=True)

    def extend(self, *args, **kwargs):
        return self._mirror("extend", args, kwargs)

    def adopt_prefix(self, *args, **kwargs):
        return self._mirror("adopt_prefix", args, kwargs)

    def warmup(self, *args, **kwargs):
        return self._mirror("warmup", args, kwargs)

    def capture_padded(self, *args, **kwargs):
        return self._mirror("capture_padded", args, kwargs)

    def chaos_exit(self, rank: int, collectives: int) -> None:
        """Tests: rank `rank` (>= 1) exits at its `collectives`-th collective from now."""
        with self._lock:
            self.links[rank - 1].send(("chaos_exit", (collectives,), {}))
            self.links[rank - 1].recv()

    def _mirror(self, method: str, args: tuple, kwargs: dict, quiet: bool = False):
        """Run `method` on every rank; rank 0's result or error. A broken group raises
        RankFailure (quiet: session bookkeeping on a broken group does nothing)."""
        with self._lock:
            if not self.broken and not all(link.is_alive() for link in self.links):
                self._break("a rank process died")
            if self.broken:
                if quiet:
                    return None
                raise RankFailure(f"{self.spec.name}: {self.broken}")
            try:
                for link in self.links:
                    link.send((method, args, kwargs))
            except (OSError, EOFError) as exc:
                self._break(f"a rank stopped listening ({exc})")
                raise RankFailure(f"{self.spec.name}: {self.broken}") from exc
            try:
                result, error = getattr(self.runner, method)(*args, **kwargs), None
            except (RuntimeError, OSError) as exc:  # a collective failed: a peer died or timed out
                if not self._ranks_alive_and_erred(type(exc).__name__):
                    self._break(f"a collective failed ({exc})")
                    raise RankFailure(f"{self.spec.name}: {self.broken}") from exc
                raise
            except Exception as exc:
                result, error = None, exc
            self._answers(method, None if error is None else type(error).__name__)
            if error is not None:
                raise error
            return result

    def _ranks_alive_and_erred(self, error: str) -> bool:
        """After rank 0 raised `error` (a RuntimeError): whether every rank raised it too
        (a deterministic error of the call, the group intact)."""
        try:
            self._answers("error check", error)
            return True
        except RankFailure:
            return False

    def _answers(self, method: str, error: str | None = None) -> None:
        """Each rank's answer to the call just made: what rank 0 got (None: ok), else broken."""
        deadline = time.monotonic() + self.spec.timeout_s
        for rank, link in enumerate(self.links, start=1):
            while not link.poll(0.05):
                if not link.is_alive() or time.monotonic() > deadline:
                    self._break(f"rank {rank} {'died' if not link.is_alive() else 'did not answer'} during {method}")
                    raise RankFailure(f"{self.spec.name}: {self.broken}")
            try:
                kind, what = link.recv()
            except (OSError, EOFError):
                self._break(f"rank {rank} died during {method}")
                raise RankFailure(f"{self.spec.name}: {self.broken}") from None
            got = None if kind in ("ok", "ready") else what
            if got != error:
                self._break(f"rank {rank} answered {method} with {got or 'ok'}, rank 0 with {error or 'ok'}")
                raise RankFailure(f"{self.spec.name}: {self.broken}")

    def _break(self, why: str) -> None:
        """The group is unusable: stop the other ranks (they may sit in a collective)."""
        if not self.broken:
            self.broken = why
            log.error("%s: tensor-parallel group broken: %s", self.spec.name, why)
        for link in self.links:
            link.kill()

    def shutdown(self) -> None:
        with self._lock:
            for link in self.links:
                try:
                    link.send(("stop", (), {}))
                except (OSError, EOFError):
                    pass
            for link in self.links:
                link.join(timeout_s=5)
            self.broken = self.broken or "shut down"

    def __del__(self) -> None:
        for link in self.__dict__.get("links", ()):
            link.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_threads(size: int) -> int:
    """Torch threads per rank: the process's threads shared by the ranks (at least one)."""
    return max(1, torch.get_num_threads() // size)


def parallel_runner(
    model,
    name: str,
    kv: KVSpec | None,
    small: bool = False,
    classifier_path=None,
    prefix_cache: PrefixCacheSpec | None = PrefixCacheSpec(),
    tensor_parallel: int = 1,
    device: str | None = None,
    launch: Launcher = spawn_ranks,
):
    """make_runner (runners/factory.py), or with tensor_parallel N > 1 a TensorParallelRunner:
    the model split over N ranks, each running make_runner's runner over its shard. device:
    where the ranks run ("cuda": rank r on cuda:r) when the model was loaded elsewhere (a model
    larger than one GPU is loaded on the host and split from there); None: the model's.
    launch: how ranks 1..N-1 start (launch.py; a LargeModel replica's: Ray actors)."""
    if tensor_parallel <= 1:
        return make_runner(model, name, kv, small, classifier_path, prefix_cache)
    spec = spec_for(model, name, tensor_parallel, kv, small, classifier_path, prefix_cache)
    return TensorParallelRunner(model, spec if device is None else replace(spec, device=device), launch)


def spec_for(model, name: str, size: int, kv, small: bool, classifier_path, prefix_cache) -> RankSpec:
    """make_runner's arguments as a RankSpec: the model's dtype and device, its kernels, and
    the process's torch threads shared by the ranks."""
    from backoff_core.models.kernels import RowBucketed

    weight = next(model.parameters())
    on_onednn = any(isinstance(m, RowBucketed) for m in model.modules())
    return RankSpec(
        name=name,
        size=size,
        kv=kv,
        small=small,
        classifier_path=None if classifier_path is None else str(classifier_path),
        prefix_cache=prefix_cache,
        dtype=torch.float32 if weight.is_mkldnn else weight.dtype,
        device=weight.device.type,
        cpu_kernels="mkldnn" if on_onednn else "default",
        threads=rank_threads(size),
    )


def engine_from_chain(chain, sizes: list[int], kv: KVSpec | None = None, classifier_path=None, **kwargs):
    """BackoffEngine.from_chain with the model of level i over sizes[i] ranks (1: in this
    process, as from_chain holds it); `backoff generate --small-tp / --large-tp`."""
    from backoff_core.engine.engine import BackoffEngine
    from backoff_core.models.default_pair import default_head_dir
    from backoff_core.types import level_names

    if len(sizes) != len(chain.models):
        raise ValueError(f"{len(sizes)} tensor-parallel sizes for a chain of {len(chain.models)} models")
    names = level_names(len(chain.models))
    path = default_head_dir(chain) if classifier_path is None else classifier_path
    runners = [
        parallel_runner(m, n, kv, level == 0, path if level == 0 else None, tensor_parallel=size)
        for level, (m, n, size) in enumerate(zip(chain.models, names, sizes))
    ]
    kwargs.setdefault("context_window", chain.context_window)
    kwargs.setdefault("hidden_size", chain.models[0].config.hidden_size)
    return BackoffEngine(runners, chain.tokenizer, classifier_path=path, **kwargs)
