"""StaticRunner on a GPU with captured CUDA graphs: equal to plain transformers greedy
decoding (float32, tiny G=2 pair), close to a float32 reference in bf16 at the real
attention shapes (G=3: the 135M shape's 9/3 heads of 64; G=4: the 8B shape's 32/8 heads of
128), on the memory-efficient SDPA kernel, with every forward of a step replayed from a
graph; and the counter hash gives the same numbers on CUDA as on the CPU. On the GPU where
one is present (`pytest -m cuda` selects these; scripts/gpu_bench.sh tests runs them), and
rehearsed on the CPU always (tests/support/cuda_shapes.py), but for what only a GPU has."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from backoff_core.engine.engine import BackoffEngine
from backoff_core.errors import KVCapacityError
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_forward import Batch
from backoff_core.sampling import Stream, sample_rows, uniforms
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams, Verification
from tests.support.cuda_shapes import (
    DEVICES,
    LONG,
    PROMPTS,
    SHAPE_PARAMS,
    SHAPES,
    cuda_only,
    rel_err,
    shaped_model,
    with_graphs,
)
from tests.support.helpers import penalized_greedy, request
from tests.support.tiny import VOCAB, tiny_model


def runner(model, name, slots=8, max_len=128, fuse=False, compiled=False, **warmup) -> StaticRunner:
    run = StaticRunner(
        model,
        name,
        kv_budget_tokens=slots * max_len,
        max_len=max_len,
        cuda_graphs=True,
        fuse_projections=fuse,
        compile_layers=compiled,
    )
    graphs, _ = with_graphs(run).warmup(progress=False, **warmup)
    assert graphs > 0 and run.graphs is not None
    return run


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


def needs_cuda(device: str) -> None:
    if device != "cuda":
        pytest.skip("CUDA streams and events: nothing to rehearse on the CPU")


@pytest.fixture(scope="module")
def gpu_pair(device):
    small, large = tiny_model(1, sharpness=30), tiny_model(2, hidden=64, layers=4, sharpness=30)
    return small.to(device).float(), large.to(device).float()


@pytest.fixture(scope="module")
def engine(gpu_pair, tokenizer):
    """16 slots each: test_batched_equals_alone holds 9 requests at once, and M_S takes its
    slot when a request opens. M_S captures what factory.make_runner captures for it, over
    fused projections as there."""
    small = runner(gpu_pair[0], "small", slots=16, fuse=True, last_only=(True,), ks=(1, 2))
    return BackoffEngine([small, runner(gpu_pair[1], "large", slots=16)], tokenizer)


@torch.inference_mode()
def greedy(model, prompt, n) -> tuple[int, ...]:
    out = model.generate(
        torch.tensor([list(prompt)], device=model.device),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return tuple(out[0, len(prompt) :].tolist())


@torch.inference_mode()
def full_logits(model, ids) -> torch.Tensor:
    """[len(ids), V] logits of a plain forward over the whole sequence (no cache)."""
    return model(torch.tensor([list(ids)], device=model.device)).logits[0].float()


@pytest.mark.parametrize("prompt", [*PROMPTS, LONG])
def test_always_small_and_always_large_are_greedy(engine, gpu_pair, prompt):
    replays = [m.forward_passes - m.eager_passes for m in engine.models]
    for router, model in (("always-small", gpu_pair[0]), ("always-large", gpu_pair[1])):
        assert engine.generate(request(prompt, 20, router)).token_ids == greedy(model, prompt, 20)
    assert all(m.forward_passes - m.eager_passes > r for m, r in zip(engine.models, replays))  # graphs ran


@pytest.mark.parametrize(
    "routing", [dict(router="draft", draft_tokens=4, verification=Verification.EXACT), dict(router="random", rate=0.8)]
)
def test_every_forward_of_a_step_replays_a_graph(engine, routing):
    """Drafts of 4 fully accepted feed M_S two tokens (a k=2 graph); the 40-token prompt's
    first catch-up runs as blocks of a captured size; no forward of a step runs eagerly (M_S's
    prompt prefill at admission may: it has graphs for k = 1 and 2 only)."""
    reqs = [request(p, 24, seed=3, **routing) for p in [*PROMPTS, LONG]]
    request_ids = [engine.submit(r) for r in reqs]
    eager = [m.eager_passes for m in engine.models]
    while engine.has_work():
        engine.step()
    assert all(len(engine.finish(r).token_ids) == 24 for r in request_ids)
    assert [m.eager_passes for m in engine.models] == eager


def test_compiled_layers_in_graphs_are_greedy_and_never_eager(device, gpu_pair, tokenizer):
    """Both models' decoder layers compiled by inductor and captured in CUDA graphs (float32):
    always-small and always-large are each model's greedy decoding, and no step runs eagerly.
    (On the CPU test_static_compiled.py proves the compiled runner greedy.)"""
    needs_cuda(device)
    small = runner(gpu_pair[0], "small", slots=4, compiled=True, last_only=(True,), ks=(1, 2))
    large = runner(gpu_pair[1], "large", slots=4, compiled=True)
    assert small._forward.compiled.compiles > 0 and large._forward.compiled.compiles > 0
    engine = BackoffEngine([small, large], tokenizer)
    for prompt in PROMPTS:
        eager = [m.eager_passes for m in engine.models]
        for router, model in (("always-small", gpu_pair[0]), ("always-large", gpu_pair[1])):
            assert engine.generate(request(prompt, 16, router)).token_ids == greedy(model, prompt, 16)
        assert engine.models[1].eager_passes == eager[1]  # M_S's prompt prefill may run eagerly


def test_mixed_routing_takes_each_token_from_its_source(engine, gpu_pair):
    for seed in (1, 2):
        result = engine.generate(request(PROMPTS[0], 24, "random", rate=0.5, seed=seed))
        assert 0 < sum(result.sources) < 24
        seq = list(PROMPTS[0])
        for token, source in zip(result.token_ids, result.sources):
            assert token == int(full_logits(gpu_pair[source], seq)[-1].argmax())
            seq.append(token)


@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_speculative_greedy_is_large_alone(engine, gpu_pair, draft_tokens):
    reqs = [request(p, 20, "draft", draft_tokens=draft_tokens, verification=Verification.EXACT) for p in PROMPTS]
    results = engine.generate_many(reqs)
    assert [r.token_ids for r in results] == [greedy(gpu_pair[1], p, 20) for p in PROMPTS]
    assert sum(r.rollbacks for r in results) > 0


def test_penalized_speculative_greedy_is_large_alone_with_the_penalties(engine, gpu_pair):
    """Penalties' counts on the device (engine/penalties.py): drafts verified exactly at earlier
    positions and rolled back give M_L's own penalized greedy decoding, for each request of a
    batch."""
    want = [penalized_greedy(gpu_pair[1], p, 16, presence=0.4, frequency=0.3, repetition=1.3) for p in PROMPTS]
    sampling = SamplingParams(
        max_tokens=16, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3
    )
    routing = RoutingParams(router="draft", draft_tokens=3, verification=Verification.EXACT)
    results = engine.generate_many([GenerationRequest(p, sampling, routing) for p in PROMPTS])
    assert [r.token_ids for r in results] == want
    assert sum(r.rollbacks for r in results) > 0


def test_batched_equals_alone(engine):
    reqs = [request(p, 12, r, rate=0.5, seed=4) for p in PROMPTS for r in ("random", "always-small", "always-large")]
    alone = [engine.generate(r) for r in reqs]
    together = engine.generate_many(reqs)
    assert [a.token_ids for a in alone] == [t.token_ids for t in together]
    assert [a.sources for a in alone] == [t.sources for t in together]
    assert [m.request_ids() for m in engine.models] == [[], []]


@pytest.mark.parametrize("wait_ms", [0.0, 40.0])
def test_steps_launched_ahead_give_the_synchronous_tokens_from_graphs(engine, wait_ms):
    """launch_ahead (engine/ahead.py) over the same runners: M_S's next step queued with the
    drawn ids on the device, into the graphs' uploaded ids before the replay; sampled, random
    routing at 50%, 12 requests: every token and source is the loop's without, M_S's steps
    take launched rows, no forward of a step runs eagerly, no session is left open."""
    reqs = [request(p, 16, "random", rate=0.5, seed=7 + i, temperature=1.0) for i, p in enumerate(PROMPTS * 4)]
    engine.catch_up_wait_ms = wait_ms
    try:
        sync = engine.generate_many(reqs)
        ahead = BackoffEngine(engine.models, engine.tokenizer, catch_up_wait_ms=wait_ms, launch_ahead=True)
        request_ids = ahead.submit_many(reqs)
        eager = [m.eager_passes for m in engine.models]
        while ahead.has_work():
            ahead.step()
        assert [m.eager_passes for m in engine.models] == eager
        launched = [ahead.finish(r) for r in request_ids]
    finally:
        engine.catch_up_wait_ms = 40.0
    assert [r.token_ids for r in launched] == [r.token_ids for r in sync]
    assert [r.sources for r in launched] == [r.sources for r in sync]
    assert ahead.ahead.rows_used > 0 and 0 < sum(r.sources.count(1) for r in launched)
    assert [m.request_ids() for m in engine.models] == [[], []]


def streams_of(monkeypatch, runner) -> list[torch.cuda.Stream]:
    """The current CUDA stream at each of runner's extends, from now on."""
    seen, extend = [], runner.extend

    def recorded(*args, **kwargs):
        seen.append(torch.cuda.current_stream())
        return extend(*args, **kwargs)

    monkeypatch.setattr(runner, "extend", recorded)
    return seen


@pytest.mark.parametrize("first", [None, "loop", "flight"])
@pytest.mark.parametrize("wait_ms", [0.0, 40.0])
def test_catch_ups_in_flight_on_a_side_stream_give_the_synchronous_tokens(device, engine, wait_ms, first, monkeypatch):
    """overlap_catch_ups: M_L's catch-ups run on the worker thread's own CUDA stream beside
    M_S's steps (engine/flight.py); every M_S forward on the loop's stream (the caller's, or
    with first="loop" a stream of its own), and the stream that goes first of higher
    priority than the other; sampled, random routing at 50%, 12 requests: every token and
    source is the synchronous loop's, and no session is left open."""
    needs_cuda(device)
    reqs = [request(p, 16, "random", rate=0.5, seed=7 + i, temperature=1.0) for i, p in enumerate(PROMPTS * 4)]
    engine.catch_up_wait_ms = wait_ms
    sync = engine.generate_many(reqs)
    caller = torch.cuda.current_stream()
    engine.overlap_catch_ups = True
    engine.launcher.first = first
    small, large = streams_of(monkeypatch, engine.models[0]), streams_of(monkeypatch, engine.models[1])
    try:
        flying = engine.generate_many(reqs)
        side, loop = engine.launcher.stream, engine.launcher.loop_stream or caller
        assert side is not None and side != loop  # a side stream, not the loop's
        assert set(small) == {loop} and side in large and set(large) <= {side, loop}
        priorities = {"loop": loop.priority < side.priority, "flight": side.priority < loop.priority}
        assert priorities == {"loop": first == "loop", "flight": first == "flight"}, (loop.priority, side.priority)
    finally:
        engine.launcher.first = None
        engine.overlap_catch_ups = False
        engine.catch_up_wait_ms = 40.0
    assert torch.cuda.current_stream() == caller  # the caller's stream is its own again
    assert [r.token_ids for r in flying] == [r.token_ids for r in sync]
    assert [r.sources for r in flying] == [r.sources for r in sync]
    assert 0 < sum(r.sources.count(1) for r in flying)
    assert [m.request_ids() for m in engine.models] == [[], []]


def test_penalized_catch_ups_in_flight_give_the_synchronous_tokens(device, engine):
    """Penalties' counts on the device (engine/penalties.py) folded on the flight's side stream
    and read on the loop's, and the reverse (a fold records the stream that read the counts it
    frees); on the CPU, folded on the flight's worker thread. Sampled, random routing at 50%:
    every token the synchronous loop's."""
    sampling = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, frequency_penalty=0.6)
    routing = RoutingParams(router="random", rate=0.5)
    reqs = [
        GenerationRequest(p, dataclasses.replace(sampling, seed=7 + i, repetition_penalty=1.0 + 0.2 * (i % 2)), routing)
        for i, p in enumerate(PROMPTS * 4)
    ]
    sync = engine.generate_many(reqs)
    engine.overlap_catch_ups = True
    try:
        flying = engine.generate_many(reqs)
        flown = engine.flights.launched
    finally:
        engine.overlap_catch_ups = False
    assert [r.token_ids for r in flying] == [r.token_ids for r in sync]
    assert 0 < sum(r.sources.count(1) for r in flying)
    assert flown > 0  # some catch-ups flew


def test_catch_ups_in_flight_over_per_session_caches_stay_on_the_loops_stream(gpu_pair, tokenizer):
    """Per-session caches reallocate at every extend, so a flight over them gets no stream of
    its own (flight.side_stream_device); sampled, random at 50%: the synchronous tokens."""
    engine = BackoffEngine([ModelRunner(gpu_pair[0], "small"), ModelRunner(gpu_pair[1], "large")], tokenizer)
    reqs = [request(p, 12, "random", rate=0.5, seed=11 + i, temperature=1.0) for i, p in enumerate(PROMPTS * 2)]
    sync = engine.generate_many(reqs)
    engine.overlap_catch_ups = True
    flying = engine.generate_many(reqs)
    assert engine.launcher.stream is None and engine.flights.launched > 0
    assert [(r.token_ids, r.sources) for r in flying] == [(r.token_ids, r.sources) for r in sync]


def test_the_sharing_probe_replays_both_models_side_by_side(device, engine):
    """benchmarks/gpu_check.sharing (what gpu_sim --what-if shared reads): M_S's full-batch
    step graph and M_L's gathered k=8 graph, each timed alone, then side by side on two
    streams as a flight runs beside the loop's steps, the loop's stream of the flight's
    priority and with either first (`first`: "loop", "flight"). Slowdowns positive and finite, and the
    engine's tokens unchanged after it (its replays run on harmless inputs)."""
    from benchmarks.gpu_probes import sharing

    needs_cuda(device)
    reqs = [request(p, 12, "random", rate=0.5, seed=3) for p in PROMPTS]
    before = engine.generate_many(reqs)
    got = sharing(engine.models, repeats=3)
    assert (got["small"]["dense"], got["small"]["k"], got["large"]["dense"], got["large"]["k"]) == (True, 1, False, 8)
    assert got["small_ms"] > 0 and got["large_ms"] > 0
    assert set(got["first"]) == {"loop", "flight"}
    for side_by_side in (got, *got["first"].values()):  # one priority, then each side first
        assert side_by_side["small_steps_within"] >= 1
        assert 0.2 < side_by_side["small_slowdown"] < 1000 and 0.2 < side_by_side["large_slowdown"] < 1000, got
    after = engine.generate_many(reqs)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]


@pytest.mark.parametrize("last_only", [True, False])
def test_catch_ups_in_blocks_replay_modelrunners_logits(gpu_pair, last_only):
    """Ragged catch-ups of 1 to 40 tokens over 8 slots, laid out as the replays timed at load
    choose (blocks: several rows to a request, a later block reading the keys its earlier
    ones wrote in the same replay), every forward a graph: ModelRunner's logits (HF's own
    forward over DynamicCaches)."""
    model = gpu_pair[1]
    run, ref = runner(model, "large"), ModelRunner(model, "ref")
    sids = [f"s{i}" for i in range(8)]
    for i, request_id in enumerate(sids):
        for r in (run, ref):
            r.open(request_id)
            r.extend([(request_id, list(range(1, 3 + 2 * i)))])
    layouts, inner = [], run._run
    run._run = lambda plan, columns=None, **kw: layouts.append(plan.key) or inner(plan, columns, **kw)
    eager = run.eager_passes
    items = [
        (s, [(7 * i + j) % VOCAB for j in range(c)]) for i, (s, c) in enumerate(zip(sids, (3, 1, 2, 40, 7, 4, 2, 5)))
    ]
    got, expected = run.extend(items, last_only=last_only), ref.extend(items, last_only=last_only)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.logits, e.logits, atol=1e-4, rtol=1e-4)
    # 8 rows a forward at most: blocks of 8 or 16 (1 + 1 + 1 + 5 or 3 + 1 + 1 + 1 + 1 rows), two
    # gathered forwards either way; no k holds the 40 tokens in one row, and no chunks
    assert run.eager_passes == eager and len(layouts) == 2
    assert all(not key.dense and key.k in (8, 16) for key in layouts), layouts


def test_rollback_equals_recomputation(gpu_pair):
    model = gpu_pair[1]
    run = runner(model, "large")
    run.open("a")
    run.open("b")
    run.extend([("a", list(range(1, 30))), ("b", [2, 3])])
    run.crop("a", 12)
    got = run.extend([("a", [40, 41, 42]), ("b", [4])])  # ragged k = 3 and 1: a k=4 graph
    torch.testing.assert_close(
        got[0].logits, full_logits(model, list(range(1, 13)) + [40, 41, 42])[-3:], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(got[1].logits, full_logits(model, [2, 3, 4])[-1:], atol=1e-4, rtol=1e-4)


def test_kv_budget_and_slot_reuse(gpu_pair):
    model = gpu_pair[0]
    run = runner(model, "small", slots=2, max_len=64)
    run.open("a")
    run.open("b")
    with pytest.raises(KVCapacityError, match="kv_budget_tokens=128"):
        run.open("c")
    run.extend([("a", [5] * 40), ("b", [6])])
    with pytest.raises(KVCapacityError, match="limit of 63"):
        run.extend([("a", [1] * 24)])
    assert run.length("a") == 40
    run.close("a")
    run.open("c")  # a's slot, a's 40 keys still in it
    got = run.extend([("c", [1, 2, 3])])[0].logits
    torch.testing.assert_close(got, full_logits(model, [1, 2, 3]), atol=1e-4, rtol=1e-4)


# -- bf16 at the real attention shapes ------------------------------------------------------
@pytest.mark.parametrize("fuse", [False, True, "compiled"], ids=["modules", "fused", "compiled"])
@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@torch.inference_mode()
def test_bf16_real_shapes_match_a_float32_reference(device, shape, fuse):
    """Every kind of extend the engine makes (steps, ragged catch-ups, verification's full
    logits, a 40-token catch-up in blocks), replayed from bf16 graphs: as close to the float32
    model as HF's own bf16 forward is, and no forward eager. Compiled layers (inductor's
    Triton kernels inside the graphs) on the GPU only: on the CPU test_static_compiled.py
    proves them in float32."""
    if fuse == "compiled" and device != "cuda":
        pytest.skip("inductor's C++ at the real shapes: test_static_compiled.py covers the CPU")
    model32 = shaped_model(shape, device).float()
    model16 = shaped_model(shape, device).to(torch.bfloat16)
    run = runner(model16, shape, slots=4, max_len=256, fuse=fuse is True, compiled=fuse == "compiled")
    seqs = {"a": list(PROMPTS[2]), "b": [7], "c": list(PROMPTS[0])}
    for request_id in seqs:
        run.open(request_id)
    eager = run.eager_passes
    steps = [
        ({r: ids for r, ids in seqs.items()}, True),  # prompts: ragged k 8, 1, 4
        ({"a": [3], "b": [4], "c": [5]}, True),  # a step of every row
        ({"a": [6, 7], "c": [8]}, True),  # k = 2 (M_S after an accepted draft)
        ({"b": [9, 10, 11, 12, 13]}, False),  # verification: full logits, k 5 -> 8
        ({"c": LONG}, True),  # 40 tokens: blocks of a captured k, one forward
        ({"a": LONG[:21], "b": [1, 2], "c": [3]}, False),  # full logits over blocks of several rows each
    ]
    done = {r: [] for r in seqs}
    for items, last_only in steps:
        out = run.extend(list(items.items()), last_only=last_only)
        for (request_id, ids), ext in zip(items.items(), out):
            done[request_id] += ids
            full = torch.tensor([done[request_id]], device=device)
            ref = model32(full).logits[0, -len(ext.logits) :]
            hf16 = model16(full).logits[0, -len(ext.logits) :]
            assert ext.logits.dtype == torch.float32 and ext.logits.shape == ref.shape
            assert rel_err(ext.logits, ref) <= 2 * rel_err(hf16, ref) + 2e-3, (shape, request_id, len(ids))
    assert run.eager_passes == eager


@pytest.mark.parametrize("fuse", [False, True], ids=["modules", "fused"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dense", [True, False])
@cuda_only
@torch.inference_mode()
def test_attention_runs_on_the_memory_efficient_kernel(shape, dense, fuse):
    """The additive mask keeps SDPA off its math fallback: with only the efficient (and
    flash) kernels allowed, the static forward still runs, in bf16 at the real shapes (q
    from the modules' projections or a view of the fused ones)."""
    model = shaped_model(shape, "cuda").to(torch.bfloat16)
    run = StaticRunner(model, shape, kv_budget_tokens=4 * 256, max_len=256, cuda_graphs=False, fuse_projections=fuse)
    for k in (1, 4):
        batch = Batch(
            input_ids=torch.full((2, k), 5, device="cuda"),
            positions=torch.arange(k, device="cuda").repeat(2, 1),
            slots=torch.tensor([0, 1] if dense else [3, 1], device="cuda"),
            last_col=torch.full((2,), k - 1, device="cuda"),
            length=256,
            dense=dense,
            last_only=True,
            hidden_layer=None,
        )
        expected, _ = run._forward(batch)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            got, _ = run._forward(batch)
        torch.testing.assert_close(got, expected)


# -- the counter hash on CUDA and on the CPU ----------------------------------------------------
@cuda_only
def test_counter_hash_gives_the_same_numbers_on_cuda_and_cpu():
    gen = torch.Generator().manual_seed(0)
    seeds = [int(x) for x in torch.randint(0, 2**62, (4096,), generator=gen)] + [0, 1, 2**32 - 1, 2**63 - 1]
    positions = [int(x) for x in torch.randint(0, 2**20, (len(seeds),), generator=gen)]
    for stream in Stream:
        cpu = uniforms(seeds, positions, stream, 2, "cpu")
        gpu = uniforms(seeds, positions, stream, 2, "cuda")
        assert torch.equal(gpu.cpu(), cpu), stream
    probs = torch.softmax(torch.randn(len(seeds), 49152, generator=gen) * 3, dim=-1)
    tokens_cpu = sample_rows(probs, seeds, positions)
    tokens_gpu = sample_rows(probs.cuda(), seeds, positions)
    assert torch.equal(tokens_gpu.cpu(), tokens_cpu)
