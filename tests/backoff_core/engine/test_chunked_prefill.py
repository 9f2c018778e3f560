"""Chunked prefill (engine/chunked.py): outputs equal chunking off, token for token; at most
one chunk per model and step; live streams keep committing while a long prompt loads."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.static import StaticRunner
from backoff_core.types import GenerationRequest, Verification
from tests.support.helpers import request

CHUNK = 8
LONG = tuple((7 * i + 3) % 40 + 2 for i in range(61))  # 60 head positions: 8 chunks of 8


class Counted:
    """A runner that records the row lengths of every extend, per step (`step` is set by the test)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.step = -1  # -1: admission
        self.forwards: list[tuple[int, list[int], bool]] = []  # (step, new ids per row, last_only)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def extend(self, items, hidden_layer=None, last_only=False, **kwargs):
        self.forwards.append((self.step, [len(ids) for _, ids in items], last_only))
        return self.runner.extend(items, hidden_layer=hidden_layer, last_only=last_only, **kwargs)


def _engine(pair, tokenizer, chunk, storage="dynamic") -> BackoffEngine:
    if storage == "static":
        runners = [StaticRunner(m, n, kv_budget_tokens=16 * 128, max_len=128) for m, n in zip(pair, ("small", "large"))]
    else:
        runners = [ModelRunner(m, n) for m, n in zip(pair, ("small", "large"))]
    return BackoffEngine([Counted(r) for r in runners], tokenizer, prefill_chunk_tokens=chunk)


def _run(engine: BackoffEngine, arrivals: dict[int, list[GenerationRequest]]) -> dict[str, tuple]:
    """Submits arrivals[s] before step s and steps until all finish; request id -> (tokens, sources)."""
    ids, s = [], 0
    while s <= max(arrivals) or engine.has_work():
        for m in engine.models:
            m.step = s
        if arrivals.get(s):
            ids += engine.submit_many(arrivals[s])
        engine.step()
        s += 1
    return {rid: (r.token_ids, r.sources) for rid, r in ((rid, engine.finish(rid)) for rid in ids)}


def _requests(temperature: float) -> dict[int, list[GenerationRequest]]:
    def r(rid, prompt, router, seed, **routing):
        req = request(prompt, 12, router, seed=seed, temperature=temperature, **routing)
        return replace(req, request_id=rid)

    return {
        0: [r("a", LONG, "random", 1, rate=0.5), r("b", (3, 4, 5), "random", 2, rate=0.5)],
        2: [r("c", LONG[:30], "always-large", 3), r("d", LONG[5:], "always-small", 4)],
        3: [r("e", LONG[:45], "random", 5, rate=0.3, eager_prefill=True)],
        5: [
            r("f", LONG[::-1], "random", 6, rate=0.5, verification=Verification.KL, tolerance=0.5),
            r("g", (9, 8), "random", 7, rate=0.5),
        ],
    }


@pytest.mark.parametrize("storage", ["dynamic", "static"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_equal_chunking_off(pair, tokenizer, storage, temperature):
    off = _run(_engine(pair, tokenizer, 0, storage), _requests(temperature))
    engine = _engine(pair, tokenizer, CHUNK, storage)
    on = _run(engine, _requests(temperature))
    assert on == off
    # the long prompts and M_L's first catch-ups were fed in chunks: no row passed a chunk
    assert all(n <= CHUNK for m in engine.models for _, rows, _ in m.forwards for n in rows)
    small, large = engine.models
    assert sum(n == CHUNK for _, rows, _ in large.forwards for n in rows) >= 5  # "a"'s 60 head positions
    assert len({src for _, srcs in on.values() for src in srcs}) == 2  # really backed off
    assert [m.request_ids() for m in engine.models] == [[], []]


def test_at_most_one_chunk_per_model_and_step(pair, tokenizer):
    engine = _engine(pair, tokenizer, CHUNK)
    arrivals = {
        0: [request((3 + i, 4, 5), 12, "random", seed=i, rate=0.5) for i in range(4)],
        2: [request(LONG, 6, "random", seed=9, rate=0.5), request(LONG[:40], 6, "always-large")],
    }
    _run(engine, arrivals)
    for m in engine.models:
        steps = {s for s, _, _ in m.forwards if s >= 0}
        for s in steps:
            rows = [r for step, r, _ in m.forwards if step == s]
            assert len(rows) <= 2  # the chunk feed and the step's decode (or catch-up) forward
            # 6 live requests at most, one token each in M_S's decode forward; catch-ups of <= 7
            assert sum(map(sum, rows)) <= CHUNK + 6 * (1 if m.name == "small" else 7)
    # chunking off, the same run prefills the long prompt in one forward: the bound above is real
    off = _engine(pair, tokenizer, 0)
    _run(off, arrivals)
    assert max(n for _, rows, _ in off.models[0].forwards for n in rows) == len(LONG) - 1


def test_live_streams_commit_every_step_while_a_long_prompt_loads(pair, tokenizer):
    engine = _engine(pair, tokenizer, CHUNK)
    engine.catch_up_wait_ms = 0  # a routed stream commits in its step (batched catch-ups make it wait on purpose)
    streams = engine.submit_many([request((3 + i, 4), 40, "random", seed=i, rate=0.5) for i in range(3)])
    engine.step()
    (new,) = engine.submit_many([request(LONG, 4, "random", seed=5, rate=0.5)])
    waited = 0
    while True:
        events = engine.step()
        assert set(streams) <= set(events)  # every stream got its token this step
        if new in events:
            break
        waited += 1
    assert waited >= math.ceil((len(LONG) - 1) / CHUNK) - 1  # the prompt head took several steps


def test_prompt_logprobs_and_bad_input_with_chunking(pair, tokenizer):
    scoring = replace(request(LONG, 3, "always-large"), sampling=replace(request(LONG).sampling, prompt_logprobs=1))
    on, off = _engine(pair, tokenizer, CHUNK), _engine(pair, tokenizer, 0)
    a, b = on.generate(scoring), off.generate(scoring)
    assert [p.chosen.logprob for p in a.prompt_logprobs[1:]] == pytest.approx(
        [p.chosen.logprob for p in b.prompt_logprobs[1:]], abs=1e-5
    )
    assert a.token_ids == b.token_ids
    windowed = BackoffEngine(on.models, tokenizer, context_window=64, prefill_chunk_tokens=CHUNK)
    with pytest.raises(ValueError, match="context window"):
        windowed.submit(request(LONG, 4))  # 61 + 4 > 64: refused before anything runs
    assert windowed.live_ids() == [] and [m.request_ids() for m in on.models] == [[], []]
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        BackoffEngine(on.models, tokenizer, prefill_chunk_tokens=-1)
