"""What the ingress hands the SmallModel, and how it becomes a GenerationRequest.

The edge's pydantic `GenerateParams` become frozen dataclasses here; the live routing
config (`RoutingConfig`, the SmallModel's user_config) fills what a request leaves open.
No Ray and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams, parse_thresholds
from clients.wire.types import ChatMessage, GenerateParams
from deployments.serving.config import RoutingConfig


@dataclass(frozen=True)
class RoutingOverrides:
    """A request's own routing fields; None = take the live config's."""

    router: str | None = None
    thresholds: tuple[float, ...] | None = None  # parse_thresholds' (checked where the request entered)
    target_backoff: float | None = None
    prefix_cache: bool = True  # RoutingParams.prefix_cache (not in the live config)


@dataclass(frozen=True)
class ServeRequest:
    """One request as the SmallModel receives it: exactly one of the three prompt forms."""

    request_id: str
    sampling: SamplingParams
    overrides: RoutingOverrides
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    echo: bool = False  # Admitted carries the prompt's ids (the SmallModel adds their text): echo, return_token_ids
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context window's)

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.prompt, self.prompt_ids, self.messages)) != 1:
            raise ValueError("a request needs exactly one of prompt, prompt_ids and messages")


MASK_64 = (1 << 64) - 1


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of a request with `n` choices: the request's own for the
    first (n = 1 is unchanged), else splitmix64's finaliser over (seed, choice), so the choices
    draw apart and a seeded request gives the same n choices again. No seed: None (each
    request draws a fresh one)."""
    if seed is None or choice == 0:
        return seed
    z = (seed + choice * 0x9E3779B97F4A7C15) & MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK_64
    z ^= z >> 31
    return z - (1 << 64) if z >> 63 else z  # an int64, as the request's own seed


def serve_request(
    request_id: str,
    params: GenerateParams,
    *,
    prompt: str | list[int] | None = None,
    messages: list[ChatMessage] | None = None,
    default_max_tokens: int = 64,
    choice: int = 0,
    prompt_ids: bool = False,
) -> ServeRequest:
    """Edge params -> ServeRequest (`choice`: which of a request's n choices; its seed is
    choice_seed's; `prompt_ids`: Admitted carries the prompt's ids, as with echo). Raises
    ValueError on values the core refuses."""
    max_tokens = default_max_tokens if params.max_tokens is None else params.max_tokens
    # echo with logprobs: the prompt's routed teacher-forced logprobs; max_tokens 0 (echo alone
    # is the prompt, scored or not) has the core score it, as the core generates nothing else
    prompt_logprobs = params.logprobs if params.echo else None
    if max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if params.temperature is None else params.temperature,
        top_k=params.top_k or 0,
        top_p=1.0 if params.top_p is None else params.top_p,
        min_p=params.min_p or 0.0,
        seed=choice_seed(params.seed, choice),
        stop=tuple(params.stop or ()),
        stop_token_ids=tuple(params.stop_token_ids or ()),
        min_tokens=params.min_tokens or 0,
        presence_penalty=params.presence_penalty or 0.0,
        frequency_penalty=params.frequency_penalty or 0.0,
        repetition_penalty=1.0 if params.repetition_penalty is None else params.repetition_penalty,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in (params.logit_bias or {}).items())),
        allowed_token_ids=tuple(sorted(set(params.allowed_token_ids or ()))),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    overrides = RoutingOverrides(
        router=params.router,
        thresholds=parse_thresholds(params.thresholds) if params.thresholds is not None else None,
        target_backoff=params.target_backoff,
        prefix_cache=params.prefix_cache,
    )
    fields = dict(echo=params.echo or prompt_ids, truncate_prompt_tokens=params.truncate_prompt_tokens)
    if messages is not None:
        chat = tuple((m.role, m.content) for m in messages)
        return ServeRequest(request_id, sampling, overrides, messages=chat, **fields)
    if isinstance(prompt, str):
        return ServeRequest(request_id, sampling, overrides, prompt=prompt, **fields)
    if prompt is None:
        raise ValueError("the request has no prompt")
    ids = tuple(int(t) for t in prompt)
    return ServeRequest(request_id, sampling, overrides, prompt_ids=ids, **fields)


def truncated(ids: list[int], keep: int | None, context_window: int | None) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens; -1: the context window's
    worth; None, or -1 without a window: all of it)."""
    if keep == -1:
        keep = context_window
    return ids[-keep:] if keep and len(ids) > keep else ids


def routing_params(overrides: RoutingOverrides, policy: RoutingConfig) -> RoutingParams:
    """A request's routing: its own fields first, then the live config. The config's
    threshold and target rate belong to the config's router, so a request that names
    another router gets that router's defaults."""
    router = overrides.router or policy.router
    own_router = router == policy.router
    thresholds = overrides.thresholds
    if thresholds is None and own_router:
        thresholds = policy.thresholds
    target = overrides.target_backoff
    if target is None and own_router and overrides.thresholds is None:
        target = policy.target_backoff
    return RoutingParams(
        router=router,
        thresholds=thresholds,
        rate=policy.rate if router == "random" else None,
        target_backoff=target,
        on_large_failure=policy.on_large_failure,
        prefix_cache=overrides.prefix_cache,
    )


def generation_request(request: ServeRequest, prompt_ids: list[int], policy: RoutingConfig) -> GenerationRequest:
    return GenerationRequest(
        tuple(prompt_ids), request.sampling, routing_params(request.overrides, policy), request.request_id
    )
