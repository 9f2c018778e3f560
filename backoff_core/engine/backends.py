"""What the step loop needs from a model: the ModelRunner surface, local or remote.

The in-process engine hands it ModelRunners; the Ray deployment hands it a proxy whose
`extend` ships pending ids to the LargeModel actor in one call (a chunk, never per token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
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
        # passed only when some item is scored; with last_only, a scored item's logits are not
        # read (a remote model answers none: [0, V]), its Extension.scored is the answer
        scoring: list[Scoring | None] | None = None,
    ) -> list[Extension]: ...
