"""The contract of backoff_core/engine/isolation.py with a fake backend: the request whose
handling raises is found, ended alone with its own error and its sessions freed; the
others keep their results. (The engine-level faults, with real forwards, are in
tests/deployments/serving/test_isolation.py.)"""

from __future__ import annotations

import pytest
import torch

from backoff_core.engine import isolation
from backoff_core.engine.state import Live
from backoff_core.routing.routers import AlwaysSmall
from tests.support.helpers import request


class Boom(RuntimeError):
    pass


class FakeBackend:
    """Records open/close calls; closing a request in `lost` raises (a lost remote session)."""

    def __init__(self, name: str, lost: tuple[str, ...] = ()) -> None:
        self.name, self.vocab_size, self.lost = name, 48, lost
        self.calls: list[tuple[str, str]] = []

    def open(self, request_id: str) -> None:
        self.calls.append(("open", request_id))

    def close(self, request_id: str) -> None:
        self.calls.append(("close", request_id))
        if request_id in self.lost:
            raise Boom(f"{self.name}: session {request_id} is gone")


def live(request_id: str, tokens=(3, 4, 5)) -> Live:
    return Live(
        request=request(tokens),
        request_id=request_id,
        router=AlwaysSmall(),
        thresholds=torch.tensor([0.5], dtype=torch.float64),
        seed=0,
        num_levels=2,
        tokens=list(tokens),
        fed=[2, 2],
        opened={0, 1},
    )


def closed(models: list[FakeBackend]) -> list[str]:
    return [request_id for m in models for op, request_id in m.calls if op == "close"]


def test_fail_keeps_the_first_error_and_closes_every_session_even_a_lost_one():
    models = [FakeBackend("small", lost=("a",)), FakeBackend("large")]
    r, first = live("a"), Boom("first")
    isolation.fail(r, first, models)
    isolation.fail(r, Boom("second"), models)
    assert r.failure is first and r.done and r.opened == set()
    assert closed(models) == ["a", "a", "a", "a"]  # both models, both times


def test_each_fails_only_the_request_whose_handler_raises():
    models = [FakeBackend("small"), FakeBackend("large")]
    group = [live("a"), live("b"), live("c")]

    def handle(r: Live) -> int:
        if r.request_id == "b":
            raise Boom("b's router")
        return len(r.request_id)

    assert isolation.each(group, models, handle) == {"a": 1, "c": 1}
    assert [r.failure is not None for r in group] == [False, True, False]
    assert closed(models) == ["b", "b"] and group[0].opened == {0, 1}


def test_batched_returns_the_shared_results_by_request_id():
    group = [live("a"), live("b")]
    out = isolation.batched(group, [FakeBackend("small")], lambda g: [10, 20], lambda r: pytest.fail("not needed"))
    assert out == {"a": 10, "b": 20} and all(r.failure is None for r in group)


def test_a_failed_batch_is_retried_alone_to_find_the_culprit():
    models, group = [FakeBackend("small")], [live("a"), live("culprit"), live("c")]

    def together(g):
        raise Boom("the batched forward")

    def alone(r: Live) -> str:
        if r.request_id == "culprit":
            raise Boom("its own forward")
        return f"{r.request_id} alone"

    out = isolation.batched(group, models, together, alone)
    assert out == {"a": "a alone", "c": "c alone"}
    assert str(group[1].failure) == "its own forward" and closed(models) == ["culprit"]
    assert group[0].failure is None and group[2].failure is None


def test_a_lone_request_whose_batch_fails_is_the_culprit_without_a_retry():
    models, r = [FakeBackend("small")], live("a")
    exc = Boom("the forward")

    def together(g):
        raise exc

    out = isolation.batched([r], models, together, lambda r: pytest.fail("no retry"))
    assert out == {} and r.failure is exc and closed(models) == ["a"]


def test_a_batch_with_too_few_results_counts_as_failed():
    """zip(strict=True): one result short must not hand a request another's result."""
    group = [live("a"), live("b")]
    out = isolation.batched(group, [FakeBackend("small")], lambda g: [10], lambda r: r.request_id)
    assert out == {"a": "a", "b": "b"}


def test_reopen_gives_a_fresh_session_rebuilt_from_every_token():
    model, r = FakeBackend("large"), live("a", tokens=(3, 4, 5, 9))
    r.opened, r.last_logits = {0}, {1: torch.zeros(4), 0: torch.ones(4)}
    ids = isolation.reopen(model, 1, r)
    assert model.calls == [("close", "a"), ("open", "a")]
    assert ids == [3, 4, 5, 9] and ids is not r.tokens
    assert r.fed == [2, 0] and r.opened == {0, 1} and list(r.last_logits) == [0]
