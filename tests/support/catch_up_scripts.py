"""Helpers of the tests of batched catch-ups and of catch-ups in flight: the large model's
runner that records its calls, scripted requests, and stepping a loop to the end."""

from __future__ import annotations

from backoff_core.errors import LargeUnavailable
from backoff_core.routing.routers import Scripted
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.static import StaticRunner
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams

PROMPT = (3, 4, 5, 6)


class Calls:
    """The large model's runner, keeping the request ids of every extend call (one per
    forward); with `fail_at`, that call (1-based) gets no reply, as from a lost replica."""

    def __init__(self, runner, fail_at: int | None = None) -> None:
        self.runner = runner
        self.calls: list[list[str]] = []
        self.fail_at = fail_at

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def extend(self, items, hidden_layer=None, last_only=False, **kwargs):
        self.calls.append([request_id for request_id, _ in items])
        if len(self.calls) == self.fail_at:
            raise LargeUnavailable("large: no reply within 0.1 s", {})
        return self.runner.extend(items, hidden_layer=hidden_layer, last_only=last_only, **kwargs)


def scripted(engine, scripts: dict[str, list[int]], **routing) -> list[str]:
    """Submit one request per script (its own Scripted router: one level per M_S step)."""
    reqs = [
        GenerationRequest(PROMPT, SamplingParams(max_tokens=len(s), ignore_eos=True), RoutingParams(**routing), rid)
        for rid, s in scripts.items()
    ]
    return engine.submit_many(reqs, [Scripted(s) for s in scripts.values()])


def run_steps(engine) -> list[set[str]]:
    """Step until done: the request ids that got a token, per step."""
    steps = []
    while engine.has_work():
        steps.append(set(engine.step()))
    return steps


def pair_runners(pair, storage: str = "dynamic", fail_at: int | None = None):
    """(M_S's runner, M_L's recorded in Calls): per-session caches, or static KV slots."""
    if storage == "static":
        small, large = (
            StaticRunner(m, n, kv_budget_tokens=16 * 64, max_len=64) for m, n in zip(pair, ("small", "large"))
        )
    else:
        small, large = (ModelRunner(m, n) for m, n in zip(pair, ("small", "large")))
    return small, Calls(large, fail_at)
