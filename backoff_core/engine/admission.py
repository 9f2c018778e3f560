"""Admission checks: a request's record (Live), with every bad input refused by a
ValueError before anything runs (the serving layers map it to HTTP 400 / INVALID_ARGUMENT),
and the decision function it names (`Routers`)."""

from __future__ import annotations

from backoff_core.engine.state import Live
from backoff_core.routing.control import HIGHEST, LOWEST, RateController, rate_prior
from backoff_core.routing.routers import DecisionFunction, build_router
from backoff_core.sampling import request_seed
from backoff_core.types import GenerationRequest


class Routers:
    """The decision functions requests name by their routing parameters, each built once
    (a classifier loads its head once) and shared by every request that names it."""

    def __init__(self, classifier_path: str | None, hidden_size: int | None) -> None:
        self.classifier_path = classifier_path
        self.hidden_size = hidden_size
        self.built: dict[tuple, DecisionFunction] = {}  # (router, rate, draft_tokens) -> it

    def __call__(self, request: GenerationRequest) -> DecisionFunction:
        r = request.routing
        if r.router == "scripted":
            raise ValueError("the scripted router is passed as an object, not by name")
        key = (r.router, r.rate, r.draft_tokens)
        if key not in self.built:
            self.built[key] = build_router(
                r.router,
                rate=r.rate,
                draft_tokens=r.draft_tokens,
                classifier_path=self.classifier_path,
                hidden_size=self.hidden_size,
            )
        return self.built[key]


def checked(
    request: GenerationRequest,
    request_id: str,
    router: DecisionFunction,
    num_levels: int,
    context_window: int | None,
    vocab: int,
    eos_ids: frozenset[int] = frozenset(),
) -> Live:
    """request's record for `router`, checked (ValueError on bad input); no session is opened."""
    total = len(request.prompt_ids) + request.sampling.max_tokens
    if context_window and total > context_window:
        raise ValueError(
            f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.sampling.max_tokens}) "
            f"exceeds the context window of {context_window} tokens"
        )
    s = request.sampling
    for what, ids in (
        ("prompt token ids", request.prompt_ids),
        ("stop_token_ids", s.stop_token_ids),
        ("logit_bias token ids", [t for t, _ in s.logit_bias]),
        ("allowed_token_ids", s.allowed_token_ids),
    ):
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"{what} must be in [0, {vocab})")
    if request.sampling.prompt_logprobs is not None and not router.scores_prompts:
        raise ValueError(f"the {router.name} router makes no decision on a prompt: prompt_logprobs needs another")
    routing = request.routing
    thresholds = routing.thresholds or router.default_thresholds(num_levels)
    if len(thresholds) != num_levels - 1:
        raise ValueError(f"{num_levels} models need {num_levels - 1} thresholds, got {len(thresholds)}")
    low, high = router.threshold_range
    if any(not low <= t <= high for t in thresholds):
        raise ValueError(f"thresholds of the {router.name} router must be in [{low}, {high}], got {list(thresholds)}")
    thresholds = tuple(min(HIGHEST, max(LOWEST, float(t))) for t in thresholds)  # finite, in float64 too
    controller = None
    if routing.target_backoff is not None:
        if num_levels != 2:
            raise ValueError("target_backoff needs exactly two models")
        # a calibrated router starts from its calibration table, then the controller steers;
        # it is told the horizon only where the request cannot end before max_tokens
        horizon = s.max_tokens if s.ignore_eos and not s.stop and not s.stop_token_ids else None
        controller = RateController(routing.target_backoff, thresholds[0], prior=rate_prior(router), horizon=horizon)
        thresholds = (controller.threshold,)
    ends = (frozenset() if s.ignore_eos else eos_ids) | frozenset(s.stop_token_ids)
    return Live(
        early_sampling=s.banning(ends) if s.min_tokens and ends else None,
        request=request,
        request_id=request_id,
        router=router,
        thresholds=thresholds,
        seed=request_seed(request.sampling.seed),
        num_levels=num_levels,
        controller=controller,
        tokens=list(request.prompt_ids),
        fed=[0] * num_levels,
    )
