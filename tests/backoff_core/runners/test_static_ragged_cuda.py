"""Ragged extends (static_ragged.py) on a GPU: FlexAttention compiled (Triton) inside captured
CUDA graphs, one per token bucket. Catch-ups replay them with ModelRunner's logits (float32,
tiny G=2 model), as close to a float32 reference in bf16 at the real attention shapes (G=3,
G=4) as HF's own bf16 forward, and the engine over them generates the padded path's tokens.
On the GPU where one is present (`pytest -m cuda`; scripts/gpu_bench.sh tests runs them), and
rehearsed on the CPU always, eager FlexAttention in the graphs' bookkeeping
(tests/support/cuda_shapes.py)."""

from __future__ import annotations

import pytest
import torch

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_ragged import RaggedKey
from tests.support.cuda_shapes import DEVICES, LONG, PROMPTS, SHAPE_PARAMS, rel_err, shaped_model, with_graphs
from tests.support.helpers import request
from tests.support.tiny import VOCAB, tiny_model


def runner(model, name, slots=8, max_len=128, ragged=True, **warmup) -> StaticRunner:
    run = StaticRunner(model, name, kv_budget_tokens=slots * max_len, max_len=max_len, cuda_graphs=True, ragged=ragged)
    with_graphs(run).warmup(progress=False, **warmup)
    return run


def spy_replays(run) -> list[RaggedKey]:
    seen, inner = [], run.graphs.replay_ragged
    run.graphs.replay_ragged = lambda key, *inputs: seen.append(key) or inner(key, *inputs)
    return seen


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def gpu_pair(device):
    small, large = tiny_model(1, sharpness=30), tiny_model(2, hidden=64, layers=4, sharpness=30)
    return small.to(device).float(), large.to(device).float()


def test_catch_ups_replay_ragged_graphs_with_model_runners_logits(gpu_pair):
    """Catch-ups of 1 to 40 tokens over 8 slots, then across the 64th position: one replay of
    the bucket's graph each, ModelRunner's logits (HF's own forward over DynamicCaches)."""
    model = gpu_pair[1]
    run, ref = runner(model, "large"), ModelRunner(model, "ref")
    assert {k for k in run.graphs.ms if isinstance(k, RaggedKey)} == {RaggedKey(t) for t in (32, 64, 128)}
    sids = [f"s{i}" for i in range(8)]
    for i, request_id in enumerate(sids):
        for r in (run, ref):
            r.open(request_id)
            r.extend([(request_id, list(range(1, 3 + 2 * i)))])
    seen, eager = spy_replays(run), run.eager_passes
    counts = (3, 1, 2, 40, 7, 4, 2, 5)  # 64 tokens
    for shift in (0, 1):
        items = [(s, [(7 * i + j + shift) % VOCAB for j in range(c)]) for i, (s, c) in enumerate(zip(sids, counts))]
        got, expected = run.extend(items, last_only=True), ref.extend(items, last_only=True)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g.logits, e.logits, atol=1e-3, rtol=1e-3)
    assert seen == [RaggedKey(64), RaggedKey(64)] and run.eager_passes == eager


def test_catch_ups_over_long_contexts_read_a_slots_later_key_blocks(gpu_pair):
    """Sessions of 150, 300 and 450 positions in slots 1, 3 and 6 (blocks of 128), between
    short ones: a catch-up's query blocks walk several key blocks of each slot, not adjacent,
    and cut causally inside a later one; one replay, ModelRunner's logits."""
    model = gpu_pair[1]
    run, ref = runner(model, "large", max_len=512), ModelRunner(model, "ref")
    lengths = {"s0": 5, "a": 150, "s2": 3, "b": 300, "s4": 4, "s5": 2, "c": 450, "s7": 6}
    for request_id, n in lengths.items():
        for r in (run, ref):
            r.open(request_id)
            r.extend([(request_id, [(5 * j + len(request_id)) % VOCAB for j in range(n)])])
    assert [run._sessions[r].slot for r in ("a", "b", "c")] == [1, 3, 6]
    seen, eager = spy_replays(run), run.eager_passes
    items = [("a", [1] * 9), ("b", [2, 3] * 7), ("c", [4] * 20), ("s5", [5, 6])]
    for g, e in zip(run.extend(items, last_only=True), ref.extend(items, last_only=True)):
        torch.testing.assert_close(g.logits, e.logits, atol=1e-3, rtol=1e-3)
    assert seen == [RaggedKey(64)] and run.eager_passes == eager


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@torch.inference_mode()
def test_bf16_real_shapes_match_a_float32_reference(device, shape):
    """Prompts and catch-ups of several items, every one a ragged replay in bf16: as close to
    the float32 model as HF's own bf16 forward is."""
    model32 = shaped_model(shape, device).float()
    model16 = shaped_model(shape, device).to(torch.bfloat16)
    run = runner(model16, shape, slots=4, max_len=256)
    # warm-up's check (the default `auto` serves ragged only past it) holds in bf16 at the real G
    assert run.ragged, "warm-up's ragged-vs-padded check turned ragged off"
    print(f"{shape}: warm-up's check, ragged vs padded bf16 logits, relative error {run.ragged_rel_err():.4f}")
    seqs = {"a": list(PROMPTS[2]), "b": [7], "c": list(PROMPTS[0])}
    for request_id in seqs:
        run.open(request_id)
    seen, eager = spy_replays(run), run.eager_passes
    steps = [seqs, {"a": [3], "b": [4, 5], "c": [6]}, {"a": list(LONG[:21]), "b": [1, 2], "c": [3]}]
    done = {r: [] for r in seqs}
    for items in steps:
        out = run.extend(list(items.items()), last_only=True)
        for (request_id, ids), ext in zip(items.items(), out):
            done[request_id] += ids
            full = torch.tensor([done[request_id]], device=device)
            ref = model32(full).logits[0, -1:]
            hf16 = model16(full).logits[0, -1:]
            assert ext.logits.dtype == torch.float32 and ext.logits.shape == ref.shape
            assert rel_err(ext.logits, ref) <= 2 * rel_err(hf16, ref) + 2e-3, (shape, request_id, len(ids))
    assert seen == [RaggedKey(32)] * 3 and run.eager_passes == eager


def test_engine_tokens_equal_the_padded_paths(gpu_pair, tokenizer):
    """Random routing, held and batched catch-ups: the same tokens and sources with M_L's
    catch-ups ragged as padded."""
    reqs = [request(p, 24, "random", rate=0.7, seed=s) for p in PROMPTS for s in (1, 2)]
    results = {}
    for ragged in (False, True):
        small = runner(gpu_pair[0], "small", ragged=False, last_only=(True,), ks=(1, 2))
        large = runner(gpu_pair[1], "large", ragged=ragged)  # 8 slots: buckets 32-128, three compiles
        seen = spy_replays(large)
        results[ragged] = BackoffEngine([small, large], tokenizer).generate_many(reqs)
        assert bool(seen) == ragged
    assert [r.token_ids for r in results[True]] == [r.token_ids for r in results[False]]
    assert [r.sources for r in results[True]] == [r.sources for r in results[False]]
