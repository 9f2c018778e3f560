"""Step stage 2 (propose): M_S's forward over every stepping request, batched, and the draw
of the tokens of the steps that stay small (one batched draw, one host copy)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from backoff_core.engine.backends import Backend
from backoff_core.engine.isolation import batched, reopen
from backoff_core.engine.state import Live
from backoff_core.sampling import draw


def small_step(models: list[Backend], group: list[Live]) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """-> sid: (logits [V], hidden [d] or None). Different routers may want different layers."""
    if not group:
        return {}
    # one engine loads one classifier head, so at most one layer is asked for
    layers = {r.router.hidden_layer for r in group} - {None}
    if len(layers) > 1:
        raise ValueError("one step cannot serve classifier heads over different layers")
    layer = next(iter(layers), None)
    model = models[0]

    def alone(r: Live):  # after a failed batch: a fresh session, re-prefilled
        return model.extend([(r.request_id, reopen(model, 0, r))], hidden_layer=layer, last_only=True)[0]

    start = time.perf_counter()
    out = batched(
        group,
        models,
        lambda g: model.extend([(r.request_id, r.tokens[r.fed[0] :]) for r in g], hidden_layer=layer, last_only=True),
        alone,
    )
    seconds = time.perf_counter() - start
    result = {}
    for r in group:
        if r.request_id not in out:
            continue  # failed: ends alone
        ext = out[r.request_id]
        r.fed[0] = len(r.tokens)
        r.small_times.append(seconds)
        result[r.request_id] = (ext.logits[-1], ext.hidden[-1] if ext.hidden is not None else None)
    return result


def draw_small(models: list[Backend], group: list[Live], small: dict) -> dict[str, int]:
    """sid -> the token each request draws from its M_S logits: one batched draw on
    the logits' device and one host copy for the whole group."""
    if not group:
        return {}

    def together(g: Sequence[Live]) -> list[int]:
        return draw(
            torch.stack([small[r.request_id][0] for r in g]),
            [r.request.sampling for r in g],
            [r.seed for r in g],
            [len(r.tokens) for r in g],
        )

    return batched(group, models, together, lambda r: together([r])[0])
