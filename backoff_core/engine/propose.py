"""Step stages 2 and 4 (propose, decide): M_S's forward over every stepping request,
batched; then the draw of their tokens and the routers' scores, read back together in one
host copy (host.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backoff_core.engine.backends import Backend
from backoff_core.engine.host import to_host
from backoff_core.engine.isolation import batched, reopen
from backoff_core.engine.state import Live
from backoff_core.routing.routers import DecisionFunction, StepContext
from backoff_core.sampling import Stream, draw, uniforms


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


@dataclass(frozen=True)
class Proposal:
    """What stage 4 read back: each stepped request's M_S token, each routed one's score."""

    tokens: dict[str, int]  # the token drawn from M_S's logits: the step's token if it stays small
    scores: dict[str, float]  # the router's score (routed requests only)


def propose(
    models: list[Backend], group: list[Live], routed: list[Live], small: dict, large: dict[str, torch.Tensor]
) -> Proposal:
    """group: requests M_S stepped (small: sid -> (logits [V], hidden [d] or None)); routed:
    those of them a router decides for (large: sid -> the largest model's logits, for
    oracles). The tokens of the whole group are drawn in one batched draw (those that go
    large waste theirs: a draw is a pure function of seed and position) and the routers
    score their rows on the device, then ONE host copy reads tokens and scores together.
    If it raises, each request alone finds the culprit (isolation.py)."""
    routed_ids = {r.request_id for r in routed}

    def together(g: Sequence[Live]) -> list[tuple[int, float | None]]:
        logits = torch.stack([small[r.request_id][0] for r in g])  # [B, V]
        tokens = draw(logits, [r.request.sampling for r in g], [r.seed for r in g], [len(r.tokens) for r in g])
        rows = [i for i, r in enumerate(g) if r.request_id in routed_ids]
        groups: dict[DecisionFunction, list[int]] = {}
        for i in rows:
            groups.setdefault(g[i].router, []).append(i)
        scores = [
            router.scores(
                _context(router, [g[i] for i in at], logits if len(at) == len(g) else logits[at], small, large)
            )
            for router, at in groups.items()
        ]
        read = to_host(tokens, *scores)
        out: list[tuple[int, float | None]] = [(t, None) for t in read[0]]
        for at, values in zip(groups.values(), read[1:]):
            for i, value in zip(at, values):
                out[i] = (out[i][0], value)
        return out

    if not group:
        return Proposal({}, {})
    start = time.perf_counter()
    got = batched(group, models, together, lambda r: together([r])[0])
    seconds = time.perf_counter() - start
    for r in routed:
        if r.request_id in got:
            r.router_times.append(seconds)  # the decision with the draw beside it: one pass, one sync
    return Proposal(
        {request_id: token for request_id, (token, _) in got.items()},
        {request_id: score for request_id, (_, score) in got.items() if score is not None},
    )


def _context(router: DecisionFunction, g: list[Live], logits: torch.Tensor, small: dict, large: dict) -> StepContext:
    """The StepContext of router's rows g (logits: their M_S logits [b, V]), on the logits' device."""
    dev = logits.device
    return StepContext(
        small_logits=logits,
        hidden=torch.stack([small[r.request_id][1] for r in g]) if router.hidden_layer is not None else None,
        large_logits=torch.stack([large[r.request_id] for r in g]) if router.needs_large_logits else None,
        drafts=torch.tensor([r.drafts() for r in g]).to(dev, non_blocking=True)
        if router.reads_drafts
        else torch.zeros(len(g), dtype=torch.long, device=dev),
        uniforms=uniforms([r.seed for r in g], [len(r.tokens) for r in g], Stream.ROUTER, device=dev)[:, 0]
        if router.reads_uniforms
        else torch.zeros(len(g), device=dev),
    )
