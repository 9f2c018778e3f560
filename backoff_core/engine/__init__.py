"""The step loop: M_S steps every request, the router hands steps to M_L, catch-ups settle."""

from backoff_core.engine.engine import BackoffEngine

__all__ = ["BackoffEngine"]
