"""The playground page (`GET /playground`): static HTML/CSS/JS in deployments/static/, served
by the Ingress on its HTTP port, no build step and no external fetch. The page streams from
/v1/chat/completions (or /v1/completions) like any client, colours each token by its source
and shows the counters; `GET /v1/routing` tells it the chain's levels, the routers a
request may name and the live routing config, so its controls match this server.

The static files need no API key (they hold code, no data: EdgeGate lets PAGE_PATH through);
/v1/routing and the completions do, and the page asks for the key when they answer 401.
"""

from __future__ import annotations

import math
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from backoff_core.types import level_names
from deployments.serving.access import EdgeGate
from deployments.serving.config import AppArgs, RoutingConfig

STATIC = Path(__file__).resolve().parents[1] / "static"
PAGE_PATH = EdgeGate.PAGE_PATH
# slider span for scores the router leaves unbounded (threshold_range is ±inf there): entropy
# in nats up to ~ln(vocab) of a 49k vocabulary, KL in nats, draft lengths; the page's number
# box takes any value beyond these
SLIDER_SPANS = {"entropy": (0.0, 11.0), "oracle": (0.0, 10.0), "flipped-oracle": (-10.0, 0.0), "draft": (1.0, 16.0)}
NO_THRESHOLD = ("always-small", "always-large")


class RouterChoice(BaseModel):
    name: str = Field(description="the router's name, as a request's `router`")
    thresholds: bool = Field(description="whether a threshold changes what it does")
    slider: tuple[float, float] = Field(description="the threshold slider's span on the page")
    defaults: list[float] = Field(description="its default thresholds on this chain (one per boundary)")


class RoutingInfo(BaseModel):
    """GET /v1/routing: what the playground's controls offer."""

    model: str = Field(description="served model name")
    levels: list[str] = Field(description="the chain, smallest first: a token's source indexes it")
    routers: list[RouterChoice] = Field(description="routers a request may name")
    router: str = Field(description="the live config's router (requests that name none use it)")
    thresholds: list[float] = Field(description="the live config's thresholds (or its router's defaults)")
    target_backoff: float | None = Field(None, description="the live config's target backoff rate, if any")


def _choice(name: str, num_levels: int, hidden_size: int | None) -> RouterChoice | None:
    from backoff_core.routing.routers import build_router  # torch: the Ingress loads it on the first GET only

    try:
        router = build_router(name, hidden_size=hidden_size)
    except (ValueError, OSError):
        return None
    low, high = router.threshold_range
    span = SLIDER_SPANS.get(name, (low, high) if math.isfinite(low) and math.isfinite(high) else (0.0, 1.0))
    defaults = [float(t) for t in router.default_thresholds(num_levels)]
    return RouterChoice(name=name, thresholds=name not in NO_THRESHOLD, slider=span, defaults=defaults)


def routing_info(args: AppArgs, model: str, policy: RoutingConfig) -> RoutingInfo:
    n = args.models.num_levels
    # the classifier is offered only with a trained head (a random head's scores mean nothing);
    # building it here would load the head, so its defaults are the base class's
    from backoff_core.routing.routers import NAMES

    names = [r for r in NAMES if r != "classifier"]
    routers = [c for c in (_choice(r, n, None) for r in names) if c is not None]
    if args.models.classifier:
        routers.append(RouterChoice(name="classifier", thresholds=True, slider=(0.0, 1.0), defaults=[0.5] * (n - 1)))
    live = next((c for c in routers if c.name == policy.router), None)
    thresholds = list(policy.thresholds) if policy.thresholds is not None else (live.defaults if live else [])
    return RoutingInfo(
        model=model,
        levels=level_names(n),
        routers=routers,
        router=policy.router,
        thresholds=thresholds,
        target_backoff=policy.target_backoff,
    )


def mount_playground(app: FastAPI) -> None:
    """`/playground` (the page) and `/playground/<file>` (its script and style sheet). The
    page refers to them relatively, so it works under any route prefix (`/chain/playground`)."""

    @app.get(PAGE_PATH, include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get(PAGE_PATH + "/", include_in_schema=False)
    async def page_slash() -> RedirectResponse:
        # the page's relative references resolve against /…/playground, not /…/playground/
        return RedirectResponse("../playground", status_code=307)

    app.mount(PAGE_PATH, StaticFiles(directory=STATIC), name="playground")
