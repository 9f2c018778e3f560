"""What the step loop needs from a model: the ModelRunner surface, local or remote.

The in-process engine hands it ModelRunners; the Ray deployment hands it a proxy whose
`extend` ships pending ids to the LargeModel actor in one call (a chunk, never per token).
"""

from __future__ import annotations

from typing import Protocol

from backoff_core.runners.dynamic import Extension
from backoff_core.runners.scoring import Scoring


class Backend(Protocol):
    name: str
    vocab_size: int

    def open(self, request_id: str) -> None: ...

    def close(self, request_id: str) -> None: ...

    def crop(self, request_id: str, length: int) -> None: ...

    def extend(
        self,
        items: list[tuple[str, list[int]]],
        hidden_layer: int | None = None,
        last_only: bool = False,
        scoring: list[Scoring | None] | None = None,  # passed only when some item is scored
    ) -> list[Extension]: ...


class SessionLost(RuntimeError):
    """The backend no longer holds a session (replica lost, TTL): re-prefill elsewhere."""


class LargeUnavailable(RuntimeError):
    """A larger model cannot answer in time (too slow, no replica left). The requests of
    the sessions that got no reply lose their larger models for good and go on with the
    small model alone, or fail, as their `on_large_failure` says; `extensions` holds the
    replies of the call's sessions that did answer (they carry on as usual)."""

    def __init__(self, message: str, extensions: dict[str, Extension] | None = None) -> None:
        super().__init__(message)
        self.extensions = extensions or {}
