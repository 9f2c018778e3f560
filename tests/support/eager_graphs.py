"""CudaGraphs without a GPU: the runners' graph bookkeeping, replayed eagerly on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

from backoff_core.runners.cuda_graphs import CudaGraphs


class EagerGraphs(CudaGraphs):
    """CudaGraphs whose 'graph' re-runs the captured body on the static buffers: the
    buckets, static inputs and output copies of the real thing, without a GPU. replay_ms
    comes from `cost(key)` (no events on the CPU): a device's timings, written down."""

    def __init__(self, *args, cost=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cost = cost or (lambda key: float(key.rows * key.k))
        self.timed: list = []  # the keys replay_ms was asked about

    def _record(self, key):
        self._body(key)  # the warm-up run, as on the GPU
        return SimpleNamespace(replay=lambda: self._body(key))

    def replay_ms(self, key, repeats: int = 3) -> float:
        self.timed.append(key)
        return self.cost(key)
