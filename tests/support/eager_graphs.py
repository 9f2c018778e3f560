"""CudaGraphs without a GPU: the runners' graph bookkeeping, replayed eagerly on the CPU; and
the StaticRunner-against-ModelRunner helpers of the runners' tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from backoff_core.runners.cuda_graphs import CudaGraphs
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.static import StaticRunner

TOL = dict(atol=1e-4, rtol=1e-4)


class EagerGraphs(CudaGraphs):
    """CudaGraphs whose 'graph' re-runs the captured body on the static buffers: the
    buckets, static inputs and output copies of the real thing, without a GPU. replay_ms
    comes from `cost(key)` (no events on the CPU): a device's timings, written down (by
    default rows x k token slots, or a ragged forward's tokens, plus a fixed 8 per forward: a
    large model's weights). A ragged graph timed far (its inputs laid out by far_layout) takes
    `far_cost(key)`, by default the near cost: attention's walk over key blocks costs nothing."""

    def __init__(self, *args, cost=None, far_cost=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cost = cost or (lambda key: 8.0 + key.token_slots / 64)
        self.far_cost = far_cost or self.cost
        self.timed: list = []  # the keys replay_ms was asked about ((key, "far") timed far)

    def _record(self, key):
        self._body(key)  # the warm-up run, as on the GPU
        return SimpleNamespace(replay=lambda: self._body(key))

    def replay_ms(self, key, repeats: int = 3, far=None) -> float:
        self.timed.append(key if far is None else (key, "far"))
        return self.cost(key) if far is None else self.far_cost(key)


def static(model, slots=8, max_len=128, name="static") -> StaticRunner:
    return StaticRunner(model, name, kv_budget_tokens=slots * max_len, max_len=max_len)


def both(model, sids, **kwargs):
    """A ModelRunner and a StaticRunner over the same model, with the same sessions open."""
    ref, run = ModelRunner(model, "ref"), static(model, **kwargs)
    for request_id in sids:
        ref.open(request_id)
        run.open(request_id)
    return ref, run


def assert_same(ref, run, items, hidden_layer=None, last_only=False):
    expected = ref.extend(items, hidden_layer=hidden_layer, last_only=last_only)
    got = run.extend(items, hidden_layer=hidden_layer, last_only=last_only)
    for (request_id, _), e, g in zip(items, expected, got):
        assert g.logits.shape == e.logits.shape and g.logits.dtype == torch.float32
        torch.testing.assert_close(g.logits, e.logits, **TOL)
        if hidden_layer is not None:
            torch.testing.assert_close(g.hidden, e.hidden, **TOL)
        assert run.length(request_id) == ref.length(request_id)


def spy_layouts(run) -> list[tuple[bool, int, int]]:
    """Record (dense, rows, k) of every forward the runner lays out."""
    seen, inner = [], run._run

    def spy(plan, columns=None, **kwargs):
        seen.append((plan.key.dense, plan.key.rows, plan.key.k))
        return inner(plan, columns, **kwargs)

    run._run = spy
    return seen


class NoTimeEvent:
    """torch.cuda.Event on the CPU: what replay_ms asks of one, with no time passing."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end) -> float:
        return 1.0
