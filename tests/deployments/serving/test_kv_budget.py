"""The KV budget of per-session caches (runner.py, the LargeModel's batcher) and the refusal
it leads to (KVCapacityError -> 503 + Retry-After), without Ray; tiny models. The budget
of static slots is tested with the StaticRunner (test_static_runner.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from backoff_core.engine.engine import BackoffEngine
from backoff_core.errors import KVCapacityError
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.factory import make_runner
from backoff_core.runners.kv_budget import bytes_per_token, kv_tokens, resolve_kv
from backoff_core.runners.static import StaticRunner
from backoff_core.types import KVSpec
from deployments.serving.batcher import CatchUpBatcher
from deployments.serving.catchup_wire import CatchUpCall
from deployments.serving.outcomes import Failed
from deployments.streams import OverloadedError, failure
from tests.support.helpers import engine_for, request
from tests.support.remote_fakes import FakeEndpoint, remote_engine
from tests.support.serve_fakes import FakeHandle, ingress_replica, large_replica, serving, small_replica
from tests.support.served_app import wait_until


def test_runner_evicts_idle_sessions_lru_and_refuses_a_new_one_the_live_ones_leave_no_room_for(pair):
    runner = ModelRunner(pair[1], "large", kv_budget_tokens=10)
    for request_id in ("a", "b", "c"):
        runner.open(request_id)
        runner.extend([(request_id, [3, 4, 5])])  # 9 positions held
    runner.extend([("a", [6])])  # a is now the most recently used; 10 held
    runner.open("d")
    runner.extend([("d", [7, 8, 9, 10])])  # needs 4: b and c (least recently used, idle) go
    assert sorted(runner.request_ids()) == ["a", "d"] and runner.kv_tokens == 8 and runner.evictions == 2
    # a new session that does not fit beside the live ones of its extend: refused, nothing changed
    runner.open("e")
    with pytest.raises(KVCapacityError, match="kv_budget_tokens=10"):
        runner.extend([("a", [1]), ("d", [2]), ("e", [3, 4, 5])])
    assert runner.kv_tokens == 8 and runner.length("a") == 4 and runner.evictions == 2
    # a held session is never refused: it grows past the budget rather than fail its request
    runner.extend([("a", [1, 2, 3, 4]), ("d", [5, 6])])
    assert runner.kv_tokens == 14 and runner.has("e")
    # re-opening an evicted session is a re-prefill of a live request: not refused either
    runner.open("b")
    runner.extend([("a", [1]), ("d", [1]), ("b", [3, 4, 5])])
    assert runner.has("b") and runner.kv_tokens == 19 and runner.has("e")  # e holds nothing: not evicted


def test_eviction_costs_a_re_prefill_not_the_output(pair, tokenizer):
    """In process: M_L's sessions evicted between catch-ups are rebuilt from the token ids the
    request keeps; every request ends with the tokens of an unbounded run."""
    reqs = [request([3 + i, 4, 5], max_tokens=24, router="random", rate=0.6, seed=i, temperature=0.7) for i in range(6)]
    unbounded = engine_for(pair, tokenizer).generate_many(reqs)
    bounded = engine_for(pair, tokenizer)
    bounded.models[1].kv_budget_tokens = 90  # 6 requests x up to 27 positions: half of them at most
    served = bounded.generate_many(reqs)
    assert [r.token_ids for r in served] == [r.token_ids for r in unbounded]
    assert bounded.models[1].evictions > 0


def test_static_slots_evict_idle_sessions_and_the_output_stays_that_of_an_unbounded_run(pair, tokenizer):
    """The same with M_L on static KV slots (make_runner, as on a GPU): 6 requests, 3 slots;
    M_L's idle sessions give up their slot to a new one and are re-prefilled later."""
    reqs = [request([3 + i, 4, 5], max_tokens=24, router="random", rate=0.6, seed=i, temperature=0.7) for i in range(6)]
    unbounded = engine_for(pair, tokenizer).generate_many(reqs)
    small = make_runner(pair[0], "small", KVSpec(budget_tokens=8 * 64, max_len=64), small=True)
    large = make_runner(pair[1], "large", KVSpec(budget_tokens=3 * 64, max_len=64))
    bounded = BackoffEngine([small, large], tokenizer)
    served = bounded.generate_many(reqs)
    assert [r.token_ids for r in served] == [r.token_ids for r in unbounded]
    assert large.evictions > 0 and small.evictions == 0


@pytest.mark.parametrize("wait_ms", [0.0, 1e4])
def test_twenty_long_requests_with_a_small_budget_all_complete_and_memory_stays_bounded(
    pair, tokenizer, loop_thread, wait_ms
):
    """The LargeModel's batcher behind RemoteLarge (the fake transport of test_serve_units):
    20 concurrent requests of 3 + 60 positions each (1260 in all) against a 360-token budget.
    Idle sessions are evicted LRU and re-prefilled at their next catch-up; after every
    forward the replica holds at most the budget, or the forward's own live sessions when
    they alone pass it. With catch-ups at once (wait_ms 0) a forward's sessions stay under
    the budget; batched catch-ups (docs/batched-catch-ups.md) share forwards between more
    sessions, which may pass it together, and nothing more is held."""
    budget, n, tokens = 360, 20, 60
    endpoint = FakeEndpoint(pair[1], loop_thread, replicas=1)
    runner = endpoint.replicas[0].runner
    runner.kv_budget_tokens = budget
    held_after: list[tuple[int, int]] = []  # (positions held, positions of the forward's sessions)
    extend = runner.extend

    def recording(items, **kwargs):
        out = extend(items, **kwargs)
        held_after.append((runner.kv_tokens, sum(runner.length(request_id) for request_id, _ in items)))
        return out

    runner.extend = recording
    engine, remote = remote_engine(pair, tokenizer, endpoint)
    engine.catch_up_wait_ms = wait_ms
    reqs = [
        request([3 + i % 7, 4, 5], max_tokens=tokens, router="random", rate=0.85, seed=i, temperature=0.8)
        for i in range(n)
    ]
    served = engine.generate_many(reqs)
    unbounded = engine_for(pair, tokenizer).generate_many(reqs)
    assert [r.token_ids for r in served] == [r.token_ids for r in unbounded]  # all complete, unchanged
    assert all(len(r.token_ids) == tokens and not r.degraded for r in served)
    assert runner.evictions > 0 and remote.lost_sessions > 0  # the budget was reached: evicted, re-prefilled
    assert all(held <= max(budget, live) for held, live in held_after), held_after
    peak = max(held for held, _ in held_after)
    if wait_ms == 0:
        assert peak <= budget < n * (3 + tokens) // 2, (peak, budget)
    else:  # the shared forwards held more sessions at once
        assert max(live for _, live in held_after) > budget >= max(h for h, live in held_after if live <= budget)
    assert runner.request_ids() == []  # freed on finish


def test_new_requests_are_refused_when_live_sessions_fill_the_budget(pair, tokenizer, loop_thread):
    """Always-large requests whose sessions are all live in every forward: the first ones fit,
    the rest are refused with KVCapacityError (a retriable 503 at the Ingress); the admitted
    ones finish whole; a refill of a live request is never refused."""
    endpoint = FakeEndpoint(pair[1], loop_thread, replicas=1)
    batcher = endpoint.replicas[0]
    batcher.runner.kv_budget_tokens = 12
    engine, _ = remote_engine(pair, tokenizer, endpoint)
    reqs = [request([3, 4, 5, 6], max_tokens=6, router="always-large") for _ in range(4)]
    rids = [engine.submit(r) for r in reqs]
    while engine.has_work():
        engine.step()
    outcomes = []
    for request_id in rids:
        try:
            outcomes.append(engine.finish(request_id).token_ids)
        except KVCapacityError as exc:
            outcomes.append(exc)
    refused = [o for o in outcomes if isinstance(o, KVCapacityError)]
    done = [o for o in outcomes if not isinstance(o, KVCapacityError)]
    alone = engine_for(pair, tokenizer).generate(reqs[0]).token_ids
    assert len(refused) == 1 and len(done) == 3 and all(d == alone for d in done)  # 3 x 4 = 12 fit at first
    assert batcher.stats.refused == 1 and "kv_budget_tokens=12" in str(refused[0])
    # a refill (a lost session of a live request) goes in whatever the budget says
    loop_thread.run(batcher.extend(CatchUpCall("x", 0, tuple(range(3, 10)), owner="r")))
    reply = loop_thread.run(batcher.extend(CatchUpCall("y", 0, tuple(range(3, 10)), owner="r", refill=True)))
    assert reply.logits is not None and not reply.refused
    reply = loop_thread.run(batcher.extend(CatchUpCall("z", 0, tuple(range(3, 10)), owner="r")))
    assert reply.logits is not None  # x and y were idle: evicted for z
    assert sorted(batcher.runner.request_ids()) == ["z"] and batcher.owners() == {"r": 1}


def test_a_kv_refusal_is_a_503_with_retry_after():
    exc = failure(Failed("no KV room", unavailable=True, code="kv_capacity"))
    assert isinstance(exc, OverloadedError) and exc.status == 503 and exc.code == "kv_capacity"
    assert exc.retry_after == "1"
    assert type(exc)(*exc.__reduce__()[1]).code == "kv_capacity"  # survives the pickle to the gRPC proxy


def test_auto_budget_and_storage_resolve_on_the_models_device(pair):
    large = pair[1]
    per_token = bytes_per_token(large)
    assert per_token == 2 * 4 * 2 * 16 * 4  # K and V x layers x kv heads x head dim x float32
    kv = resolve_kv(large, "auto", max_len=64)
    assert not kv.static and kv.budget_tokens * per_token > 2**20  # CPU: per-session caches, a share of RAM
    assert resolve_kv(large, 1000, max_len=64, static=True) == KVSpec(1000, 64, True, True)
    runner = make_runner(large, "large", KVSpec(500, 64, static=False))
    assert isinstance(runner, ModelRunner) and runner.kv_budget_tokens == 500
    runner.open("a")
    runner.extend([("a", [3, 4, 5])])
    assert kv_tokens(runner) == 3


def test_batcher_refuses_a_new_session_when_static_storage_has_no_free_slot(pair, loop_thread):
    from backoff_core.runners.static import StaticRunner

    runner = StaticRunner(pair[1], "large", kv_budget_tokens=64, max_len=32, cuda_graphs=False)  # 2 slots
    batcher = CatchUpBatcher(runner)
    for key in ("a", "b"):
        assert loop_thread.run(batcher.extend(CatchUpCall(key, 0, (3, 4)))).logits is not None
    reply = loop_thread.run(batcher.extend(CatchUpCall("c", 0, (3, 4))))
    assert reply.logits is None and "no free KV slot" in reply.refused and batcher.stats.refused == 1
    assert kv_tokens(runner) == 64


@pytest.mark.parametrize("mode, warns", [("on", True), ("auto", False), ("off", False)])
def test_ragged_catch_ups_are_the_larger_models_and_cuda_only(pair, caplog, mode, warns):
    """KVSpec.ragged: M_S never (one token a row pads nothing); M_L on the CPU stays padded
    (FlexAttention would run eagerly there, materialising every score), with a warning where
    "on" asked for them; "auto", the default, says nothing."""
    kv = KVSpec(budget_tokens=4 * 128, max_len=128, ragged=mode)
    small = make_runner(pair[0], "small", kv, small=True)
    with caplog.at_level("WARNING", logger="backoff_core.runners.factory"):
        large = make_runner(pair[1], "large", kv)
    assert isinstance(large, StaticRunner) and small.ragged is False and large.ragged is False
    assert ("ragged catch-ups need CUDA" in caplog.text) is warns
    assert KVSpec(budget_tokens=4 * 128, max_len=128).ragged == "auto"


def test_backoff_serve_prints_auto_and_takes_a_budget_and_storage():
    import yaml

    from deployments.serve_cli import DEFAULT_CONFIG, _parser, apply_overrides
    from deployments.serving.models_config import ModelsConfig

    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    models = ModelsConfig.model_validate(base["applications"][0]["args"]["models"])
    assert models.kv_budget_tokens == "auto" and models.static_kv == "auto"  # what --print-config shows
    args = _parser().parse_args(["--kv-budget", "4096", "--static-kv", "false"])
    models = ModelsConfig.model_validate(apply_overrides(base, args)["applications"][0]["args"]["models"])
    assert models.kv_budget_tokens == 4096 and models.static_kv is False
    assert _parser().parse_args(["--kv-budget", "auto"]).kv_budget_tokens == "auto"


def test_the_small_models_budget_refuses_new_requests_and_never_evicts_a_live_one(pair, tokenizer):
    """M_S extends every live request every step and the step loop cannot rebuild its session,
    so its per-session caches never evict: once the live requests fill its budget a new
    request is refused at admission (KVCapacityError: the 503 kv_capacity of engine_loop)."""
    from backoff_core.engine.engine import BackoffEngine

    small = make_runner(pair[0], "small", KVSpec(40, 64, static=False), small=True)
    engine = BackoffEngine([small, ModelRunner(pair[1], "large")], tokenizer)
    reqs = [request([3 + i, 4, 5], max_tokens=16, router="always-small") for i in range(3)]
    rids = [engine.submit(r) for r in reqs]
    for _ in range(12):  # 3 x (3 + 12) = 45 positions: past the budget, no eviction
        engine.step()
    assert small.kv_tokens > 40 and small.evictions == 0
    with pytest.raises(KVCapacityError, match="kv_budget_tokens=40"):
        engine.submit(request([9, 9], max_tokens=4))
    while engine.has_work():
        engine.step()
    alone = engine_for(pair, tokenizer)
    assert [engine.finish(request_id).token_ids for request_id in rids] == [alone.generate(r).token_ids for r in reqs]
    engine.generate(request([9, 9], max_tokens=4))  # room again once they ended


@pytest.mark.parametrize(
    "mode, max_len, graphs, small, want",
    [
        ("auto", 1024, True, False, True),
        ("auto", 1000, True, False, False),  # FlexAttention's blocks of 128 must fill a slot: padded
        ("auto", 1024, False, False, False),  # no graphs, nothing timed to choose by: padded
        ("on", 1024, False, False, True),
        ("off", 1024, True, False, False),
        ("auto", 1024, True, True, False),  # M_S: one token a row pads nothing
    ],
)
def test_where_a_cuda_model_gets_ragged_catch_ups(mode, max_len, graphs, small, want):
    """factory._ragged on a CUDA model (its device is all it reads): "auto" needs CUDA graphs and
    a max_len of whole blocks, and turns off quietly without them; "on" is the runner's to refuse."""
    from types import SimpleNamespace

    from backoff_core.runners.factory import _ragged

    model = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda"))]))
    kv = KVSpec(budget_tokens=4 * max_len, max_len=max_len, cuda_graphs=graphs, ragged=mode)
    assert _ragged(kv, model, "large", small) is want


@pytest.mark.slow  # ~10 s: refusals wait their Retry-After
def test_over_http_a_small_kv_budget_refuses_with_retry_after_and_every_request_completes(
    monkeypatch, pair, tokenizer, loop_thread
):
    """The deployments' user classes (tests/support/serve_fakes.py) behind real HTTP: an
    Ingress, a SmallModel and two LargeModel replicas, each model with a 120-token KV budget
    of per-session caches (the config's `models:`, as every replica reads it), catch-ups 10 ms
    slow. A first wave of 4 requests of 3 + 100 positions, half their steps backed off to M_L
    (the random router, seeded), fills M_S's budget (M_S steps every request and never evicts a
    live one); once it is full, whatever the machine's speed, 16 more arrive: they get 503 `kv_capacity` + Retry-After (M_S refuses at admission), and sent again
    after it every request completes with the in-process tokens. Each replica reports its
    budget, and frees what it held."""
    from backoff_core.runners.kv_budget import kv_tokens as held
    from deployments import ingress

    budget, first, n, long, tokens = 120, 4, 20, 100, 30
    models = {"kv_budget_tokens": budget, "static_kv": False}
    larges = [large_replica(monkeypatch, pair[1], models=models) for _ in range(2)]
    for large in larges:
        large.reconfigure({"inject_delay_ms": 10.0})
    routing = {"router": "random", "rate": 0.5}
    args = {"models": models, "routing": routing, "limits": {"max_concurrent_per_client": None}}
    small = small_replica(monkeypatch, pair[0], tokenizer, [FakeHandle(larges, loop_thread)], args)
    ingress_replica(monkeypatch, small)
    prompts = [[3 + i % 7, 4 + i % 3, 5] for i in range(n)]
    lengths = [long if i < first else tokens for i in range(n)]  # the first wave outlives the budget's filling
    alone = engine_for(pair, tokenizer)
    expected = [
        list(alone.generate(request(p, max_tokens=m, seed=i, **routing)).token_ids)
        for i, (p, m) in enumerate(zip(prompts, lengths, strict=True))
    ]
    refusals: list[httpx.Response] = []

    async def one(http: httpx.AsyncClient, i: int) -> list[int]:
        body = {"prompt": prompts[i], "max_tokens": lengths[i], "seed": i, "temperature": 0, "ignore_eos": True}
        for _ in range(120):
            r = await http.post("/v1/completions", json=body)
            if r.status_code != 503:
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["backoff"]["token_ids"]
            refusals.append(r)
            await asyncio.sleep(float(r.headers["Retry-After"]))
        pytest.fail("refused 120 times in a row")

    async def full() -> None:  # 4 x 30 positions held: no room for a 3-token prompt
        for _ in range(3000):
            if held(small.small_runner) > budget - 3:
                return
            await asyncio.sleep(0.005)
        pytest.fail(f"M_S never filled its budget: {held(small.small_runner)} tokens held")

    async def main(base: str) -> list[list[int]]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            wave = [asyncio.create_task(one(http, i)) for i in range(first)]
            await (
                full()
            )  # the wave has ~70 of its 100 steps left (half of them 10 ms catch-ups): the rest meet a full budget
            rest = [one(http, i) for i in range(first, n)]
            return await asyncio.gather(*wave, *rest)

    try:
        with serving(ingress.app) as base:
            outputs = asyncio.run(main(base))
        assert outputs == expected  # all complete, unchanged
        assert len(refusals) >= n - first, "the full budget did not refuse every late arrival"
        for r in refusals:
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "kv_capacity", r.text
        infos = [large.info() for large in larges]
        assert all(i.kv_budget_tokens == budget for i in infos) and small.kv.budget_tokens == budget
        assert sum(i.calls for i in infos) > 0 and all(i.calls for i in infos)  # both replicas served
        wait_until(lambda: all(large.info().kv_tokens == 0 for large in larges), "KV freed", timeout_s=30)
    finally:
        small.loop.stop()
        for large in larges:
            large.batcher.shutdown()
