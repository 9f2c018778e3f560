"""What the step loop needs from a model: the ModelRunner surface, local or remote.

The in-process engine hands it ModelRunners; the Ray deployment hands it a proxy whose
`extend` ships pending ids to the LargeModel actor in one call (a chunk, never per token).
"""

from __future__ import annotations

from typing import Protocol

from .runner import Extension


class Backend(Protocol):
    name: str
    vocab_size: int

    def open(self, session_id: str) -> None: ...

    def close(self, session_id: str) -> None: ...

    def crop(self, session_id: str, length: int) -> None: ...

    def extend(self, items: list[tuple[str, list[int]]], hidden_layer: int | None = None) -> list[Extension]: ...


class SessionLost(RuntimeError):
    """The backend no longer holds a session (replica lost, TTL): re-prefill elsewhere."""
