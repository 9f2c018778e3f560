"""benchmarks/step_overhead.py's replayed forward: a static runner whose forward hands back the
outputs of its first call of the same output shape, so the step loop runs its own host work
only (what a graph replay leaves to the host)."""

from __future__ import annotations

import torch

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.factory import make_runner
from backoff_core.types import KVSpec, RoutingParams
from benchmarks.step_overhead import ForwardClock, ms_per_step, replay_forward, tiny_pair


def test_replayed_forward_runs_the_step_loop_without_new_forwards():
    torch.manual_seed(0)
    (small, large), tokenizer = tiny_pair()
    kv = KVSpec(16 * 64, 64)
    runners = [make_runner(small, "small", kv, small=True), make_runner(large, "large", kv)]
    calls = []
    for runner in runners:
        forward = runner._forward
        runner._forward = lambda batch, forward=forward: calls.append(tuple(batch.input_ids.shape)) or forward(batch)
        replay_forward(runner)
    clock = ForwardClock()
    for runner in runners:
        clock.wrap(runner)
    engine = BackoffEngine(runners, tokenizer)
    routing = RoutingParams(router="random", rate=0.5)
    ms_per_step(engine, 4, 8, routing, 1, clock)  # every output shape seen once
    seen = len(calls)
    figures = ms_per_step(engine, 4, 8, routing, 2, clock)
    assert len(calls) == seen  # the same shapes again: nothing recomputed
    assert figures["host"] > 0 and figures["forward"] < figures["total"]
