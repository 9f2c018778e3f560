"""A larger model that stops answering (backends.LargeUnavailable), for the tests of
degrading (engine/test_backends.py) and of what degrades beside other features."""

from __future__ import annotations

from backoff_core.errors import LargeUnavailable
from backoff_core.runners.dynamic import ModelRunner


class Failing(ModelRunner):
    """The large model, until its `after`-th extend; from then on the sessions in `dead`
    (all if None) get no reply, as from a slow or lost replica."""

    def __init__(self, model, after: int, dead: set[str] | None = None) -> None:
        super().__init__(model, "large")
        self.after, self.dead = after, dead
        self.calls: list[list[str]] = []

    def extend(self, items, hidden_layer=None, last_only=False):
        self.calls.append([request_id for request_id, _ in items])
        if len(self.calls) <= self.after:
            return super().extend(items, hidden_layer, last_only)
        alive = [
            (request_id, ids) for request_id, ids in items if self.dead is not None and request_id not in self.dead
        ]
        done = (
            dict(zip([request_id for request_id, _ in alive], super().extend(alive, last_only=last_only)))
            if alive
            else {}
        )
        raise LargeUnavailable("large: no reply within 0.1 s", done)
