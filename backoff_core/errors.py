"""The failures that pass from a model to the step loop and on to the server, defined in one
place that imports no torch: the Ingress maps them to HTTP and gRPC errors without loading a
model stack (deployments/serving/outcomes.py).

- KVCapacityError: no room in a model's KV storage; nothing changed, retry later (503).
- SessionLost: a backend no longer holds a session; the step loop re-prefills it elsewhere.
- LargeUnavailable: a larger model cannot answer in time; its requests degrade or fail.
- RankFailure: a tensor-parallel rank of a model died (a LargeUnavailable).
"""

from __future__ import annotations


class KVCapacityError(RuntimeError):
    """No room in the KV storage (no free slot, or a session would pass max_len; per-session
    caches: a new session beyond the budget). Nothing was changed: the caller may retry
    later (room frees when a session closes) or refuse the request with a retriable error.
    extensions: from a remote model, the replies of the call's sessions that did fit (they
    carry on); None when the whole call was refused."""

    def __init__(self, message: str, extensions: dict | None = None) -> None:
        super().__init__(message)
        self.extensions = extensions


class SessionLost(RuntimeError):
    """The backend no longer holds a session (replica lost, TTL): re-prefill elsewhere."""


class LargeUnavailable(RuntimeError):
    """A larger model cannot answer in time (too slow, no replica left). The requests of
    the sessions that got no reply lose their larger models for good and go on with the
    small model alone, or fail, as their `on_large_failure` says; `extensions` holds the
    replies of the call's sessions that did answer (they carry on as usual): request id ->
    its runners.dynamic.Extension (not imported: this module stays below the runners)."""

    def __init__(self, message: str, extensions: dict | None = None) -> None:
        super().__init__(message)
        self.extensions = extensions or {}


class RankFailure(LargeUnavailable):
    """A tensor-parallel rank died or stopped answering: the model is unavailable."""
