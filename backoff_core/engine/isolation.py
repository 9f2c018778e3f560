"""One request's failure ends that request alone, never the step or its other requests.

The step loop batches many requests into one forward (M_S; a catch-up per level) and one
router call. Any exception raised while handling ONE request -- its sampling, its routing
or rate controller, its verification, detokenising, stop checks -- is recorded on it
(`Live.failure`; `BackoffEngine.finish` raises it) and its sessions are closed at once.
A shared call that raises (a batched forward, a batched router score) is retried for each
request alone to find the culprit; the others carry on with what they would have got.
A forward that raised may have left a cache half-written (ModelRunner extends a lone
session's cache in place, a remote proxy may have counted some replies), so a retried
request gets a fresh session re-prefilled from the token ids it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from backoff_core.engine.backends import Backend
from backoff_core.engine.state import Live

T = TypeVar("T")


def fail(r: Live, exc: Exception, models: Sequence[Backend]) -> None:
    """End r with exc (the first error wins) and free its sessions on every model now."""
    if r.failure is None:
        r.failure = exc
    for model in models:
        try:
            model.close(r.request_id)
        except Exception:  # noqa: BLE001 - a lost remote session is already gone
            pass
    r.opened.clear()


def each(group: Sequence[Live], models: Sequence[Backend], fn: Callable[[Live], T]) -> dict[str, T]:
    """sid -> fn(r) for every request of group; a request whose fn raises fails alone."""
    out: dict[str, T] = {}
    for r in group:
        try:
            out[r.request_id] = fn(r)
        except Exception as exc:  # noqa: BLE001 - ends this request, with its error
            fail(r, exc, models)
    return out


def batched(
    group: Sequence[Live],
    models: Sequence[Backend],
    together: Callable[[Sequence[Live]], list[T]],
    alone: Callable[[Live], T],
) -> dict[str, T]:
    """sid -> result of one shared call `together(group)` (one result per request, in order);
    if it raises, `alone(r)` for each request finds the culprit (a lone request is its own)."""
    try:
        return {r.request_id: out for r, out in zip(group, together(group), strict=True)}
    except Exception as exc:  # noqa: BLE001 - whose fault it is decides who fails
        if len(group) == 1:
            fail(group[0], exc, models)
            return {}
    return each(group, models, alone)


def reopen(model: Backend, level: int, r: Live) -> list[int]:
    """A fresh session of r at `level` (what a failed forward left is not trusted);
    returns the ids that rebuild it: every token r holds."""
    model.close(r.request_id)
    model.open(r.request_id)
    r.opened.add(level)
    r.fed[level] = 0
    r.last_logits.pop(level, None)
    return list(r.tokens)
