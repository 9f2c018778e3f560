"""A stand-in for the BackoffEngine: the serving path alone, at a chosen step time.

`StandInEngine` has the surface EngineLoop uses (submit, step, has_work, live_ids,
finished_ids, finish, cancel) and runs no model: a step sleeps until `step_s` has passed
since it began (sleeping, not spinning: a GPU step waits on the device with the GIL free,
and the replica's event loop shares this process) and commits one token per live request.
A token is a pure function of (seed, index): its id, its source (about half from each
level) and its text, so a served stream can be checked against `expected_stream`.

The SmallModel builds it through `AppArgs.engine_factory` (benchmark-only: the product
path imports nothing from here), e.g. `engine_factory: benchmarks.standin:engine_2ms`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from functools import partial

from backoff_core.types import FinishReason, GenerationRequest, GenerationResult, Timings, TokenEvent

VOCAB = 1000


def token_of(seed: int, index: int, num_levels: int = 2) -> tuple[int, int, str]:
    """(token id, source, text) of the index-th token of a stream with this seed."""
    h = (seed * 0x9E3779B1 + index * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    token = 3 + h % VOCAB
    return token, (h >> 16) % num_levels, f" w{token}"


def expected_stream(seed: int, max_tokens: int, num_levels: int = 2) -> list[tuple[int, int, str]]:
    return [token_of(seed, i, num_levels) for i in range(max_tokens)]


@dataclass
class _Live:
    request_id: str
    request: GenerationRequest
    started: float
    tokens: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    first_token_s: float = 0.0

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.request.sampling.max_tokens


class StandInEngine:
    """The BackoffEngine's step-loop surface over `models` (kept for num_levels only)."""

    def __init__(self, models, tokenizer, *, step_s: float, **_engine_kwargs) -> None:
        self.step_s = step_s
        self.num_levels = len(models)
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self.steps = 0

    def submit(self, request: GenerationRequest) -> str:
        request_id = request.request_id or f"standin-{next(self._ids)}"
        self._live[request_id] = _Live(request_id, request, time.perf_counter())
        return request_id

    def has_work(self) -> bool:
        return any(not r.done for r in self._live.values())

    def live_ids(self) -> list[str]:
        return list(self._live)

    def finished_ids(self) -> list[str]:
        return [request_id for request_id, r in self._live.items() if r.done]

    def cancel(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def step(self) -> dict[str, TokenEvent]:
        start = time.perf_counter()
        events = {}
        for r in self._live.values():
            if r.done:
                continue
            index = len(r.tokens)
            token, source, text = token_of(r.request.sampling.seed or 0, index, self.num_levels)
            r.tokens.append(token)
            r.sources.append(source)
            r.texts.append(text)
            events[r.request_id] = TokenEvent(token, source, text, index)
        self.steps += 1
        left = self.step_s - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        now = time.perf_counter()
        for r in self._live.values():
            if len(r.tokens) == 1 and r.request_id in events:
                r.first_token_s = now - r.started
        return events

    def finish(self, request_id: str) -> GenerationResult:
        r = self._live.pop(request_id)
        total = time.perf_counter() - r.started
        return GenerationResult(
            request_id=request_id,
            text="".join(r.texts),
            token_ids=tuple(r.tokens),
            sources=tuple(r.sources),
            num_levels=self.num_levels,
            finish_reason=FinishReason.LENGTH,
            prompt_tokens=len(r.request.prompt_ids),
            catch_ups=(),
            rollbacks=0,
            timings=Timings(0.0, (), (), r.first_token_s, total),
        )


# the factories a Serve config names (AppArgs.engine_factory); 0 ms: tokens as fast as the loop goes
engine_0ms = partial(StandInEngine, step_s=0.0)
engine_2ms = partial(StandInEngine, step_s=0.002)
engine_5ms = partial(StandInEngine, step_s=0.005)
