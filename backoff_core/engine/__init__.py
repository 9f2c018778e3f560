"""The step loop: M_S steps every request, the router hands steps to M_L, catch-ups settle.

`from backoff_core.engine import BackoffEngine` loads engine.py (and torch) on first use, not
when the package is imported: a process that needs one of its light modules (gc_heap, in the
Ingress) loads no model stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backoff_core.engine.engine import BackoffEngine

__all__ = ["BackoffEngine"]


def __getattr__(name: str):
    if name == "BackoffEngine":
        from backoff_core.engine.engine import BackoffEngine

        return BackoffEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
