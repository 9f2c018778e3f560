"""A LargeModel replica over tensor-parallel ranks (models.tensor_parallel), with Ray not
started (tests.support.serve_fakes): a SmallModel's greedy tokens through a TP=3 M_L equal
TP=1's, and a rank that dies mid-stream costs the replica, not a request: its callers see a
lost replica and re-prefill on another (0 lost, the same tokens). Rank processes start in
seconds each on two cores: `slow`. The ranks themselves: tests/backoff_core/parallel."""

from __future__ import annotations

import asyncio

import pytest
import ray

from backoff_core.types import SamplingParams, TokenEvent
from deployments import large as large_module
from deployments.serving.requests import RoutingOverrides, ServeRequest
from tests.support.serve_fakes import FakeHandle, LoopThread, large_replica, small_replica
from tests.support.tiny import tiny_model
from tests.support.tp_models import tp_model

pytestmark = pytest.mark.slow
TP = {"tensor_parallel": {"large": 3}}


class LiveHandle(FakeHandle):
    """Serve's routing after a replica died: every call to the first replica still up."""

    def route(self, key: str) -> int:
        return next(i for i, r in enumerate(self.replicas) if getattr(r.runner, "healthy", True))


def _request(request_id: str, prompt=(3, 4, 5, 6)) -> ServeRequest:
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return ServeRequest(request_id, sampling, RoutingOverrides(router="entropy", thresholds=(0.5,)), prompt_ids=prompt)


def _served(small, requests: list[ServeRequest]) -> list[list[int]]:
    async def collect(request):
        out = []
        async for item in small.generate(request):
            out += [e.token_id for e in (item if isinstance(item, tuple) else (item,)) if isinstance(e, TokenEvent)]
        return out

    async def main():
        return await asyncio.gather(*(collect(r) for r in requests))

    return asyncio.run(main())


@pytest.fixture
def serve(monkeypatch, tokenizer):
    """serve(models per replica) -> (SmallModel over a LiveHandle of those LargeModels, the replicas)."""
    lt, made = LoopThread(), []
    small_model, large_model = tiny_model(1, sharpness=30), tp_model()

    def make(*models: dict):
        larges = [large_replica(monkeypatch, large_model, models=m) for m in models]
        small = small_replica(monkeypatch, small_model, tokenizer, [LiveHandle(larges, lt)])
        made.append((small, larges))
        return small, larges

    yield make
    for small, larges in made:
        small.loop.stop()
        for large in larges:
            large.batcher.shutdown()
            getattr(large.runner, "shutdown", lambda: None)()
    lt.stop()


def test_served_greedy_tokens_through_a_tp3_large_equal_tp1(serve):
    requests = [_request(f"q{i}", (3 + i, 4, 5, 6)) for i in range(3)]
    small1, _ = serve({})
    small3, (large3,) = serve(TP)
    want, got = _served(small1, requests), _served(small3, requests)
    assert got == want and all(len(t) == 16 for t in got)
    assert large3.batcher.stats.forward_passes > 0 and large3.runner.comm.calls > 0  # M_L was asked, over 3 ranks
    info = large3.info()
    assert info.tensor_parallel == 3 and info.collective_s > 0


def test_a_rank_killed_mid_stream_loses_the_replica_not_a_request(serve, monkeypatch):
    def lost(name, exc):  # what a replica's callers see once its process exits (Serve: RayActorError)
        raise ray.exceptions.RayActorError()

    monkeypatch.setattr(large_module, "lose_replica", lost)
    requests = [_request(f"k{i}", (3 + i, 4, 5, 6)) for i in range(3)]
    small1, _ = serve({})
    want = _served(small1, requests)
    small, (tp, spare) = serve(TP, {})
    tp.runner.chaos_exit(rank=2, collectives=40)  # rank 2 dies inside a later catch-up's forward
    got = _served(small, requests)
    assert got == want  # every request finished, with the tokens of an unbroken M_L
    assert not tp.runner.healthy and spare.batcher.stats.forward_passes > 0
    with pytest.raises(RuntimeError, match="tensor-parallel group broken"):
        tp.check_health()  # Serve restarts the replica as a whole
