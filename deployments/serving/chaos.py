"""Chaos / testing knob of the SmallModel: a request that fails inside the step loop.

`RoutingConfig.inject_fault_seed` (live, like LargeModel's `inject_delay_ms`): a request
with that seed makes the M_S forwards that carry its tokens raise, from its third step on,
after the forward ran (every session of the batch has been written, as a fault late in a
real forward would leave them). The step loop must end that request alone and carry the
others on (backoff_core/engine/isolation.py). None in production. No Ray, no torch here.
"""

from __future__ import annotations

from backoff_core.engine.backends import Backend


class InjectedFault(RuntimeError):
    """The fault `inject_fault_seed` plants."""


class FaultInjector:
    """The M_S backend, passed through; forwards that carry a doomed request fail."""

    def __init__(self, inner: Backend, after: int = 3) -> None:
        self.inner, self.after = inner, after
        self.name, self.vocab_size = inner.name, inner.vocab_size
        self._doomed: dict[str, int] = {}  # request id -> forwards that carried it (test requests only)

    def doom(self, request_id: str) -> None:
        self._doomed[request_id] = 0

    def __getattr__(self, name: str):  # session_ids, forward_passes, ...: the inner runner's
        return getattr(self.inner, name)

    def open(self, request_id: str) -> None:
        self.inner.open(request_id)

    def close(self, request_id: str) -> None:
        self.inner.close(request_id)

    def crop(self, request_id: str, length: int) -> None:
        self.inner.crop(request_id, length)

    def extend(self, items, hidden_layer=None, last_only=False, **kwargs):  # kwargs: on_device, scoring
        out = self.inner.extend(items, hidden_layer, last_only, **kwargs)
        if self._doomed:
            hit = [request_id for request_id, _ in items if request_id in self._doomed]
            for request_id in hit:
                self._doomed[request_id] += 1
            if any(self._doomed[request_id] > self.after for request_id in hit):  # its retry alone fails too
                raise InjectedFault("injected fault (routing.inject_fault_seed)")
        return out
