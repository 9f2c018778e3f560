"""StaticRunner (static KV slots, in-place writes) on the CPU: every extend equals
ModelRunner's (HF's own forward with DynamicCaches), and the engine over it equals plain
transformers generation."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from backoff_core.engine.engine import BackoffEngine
from backoff_core.errors import KVCapacityError
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.static import StaticRunner
from backoff_core.types import Verification
from tests.support.eager_graphs import TOL, EagerGraphs, assert_same, both, spy_layouts, static
from tests.support.helpers import engine_for, hf_greedy, request
from tests.support.tiny import TINY_SHAPE, VOCAB, tiny_model


def llama3_model() -> LlamaForCausalLM:
    """Llama-3 rope scaling (frequencies rescaled past 16 positions) and 4 query heads per kv head."""
    torch.manual_seed(5)
    rope = dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    config = LlamaConfig(**{**TINY_SHAPE, "num_key_value_heads": 1}, rope_parameters=rope)
    return LlamaForCausalLM(config).eval()


def qwen2_model() -> Qwen2ForCausalLM:
    """Biases on q/k/v: the same structure, another model file."""
    torch.manual_seed(6)
    return Qwen2ForCausalLM(Qwen2Config(**TINY_SHAPE)).eval()


MODELS = {
    "small": lambda: tiny_model(1, sharpness=30),
    "large": lambda: tiny_model(2, hidden=64, layers=4, sharpness=30),
    "llama3": llama3_model,
    "qwen2": qwen2_model,
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def record_paths(run) -> list[bool]:
    """Wrap the eager forward to record which read path (dense view or gather) each pass took."""
    paths, forward = [], run._forward

    def spy(batch):
        paths.append(batch.dense)
        return forward(batch)

    run._forward = spy
    return paths


@pytest.mark.parametrize("last_only", [False, True])
def test_prefill_then_single_steps(model, last_only):
    ref, run = both(model, ["a"])
    assert_same(ref, run, [("a", [3, 4, 5, 6, 7, 8, 9, 10, 11, 12])], last_only=last_only)
    for t in range(70):  # crosses the 64-position length bucket
        assert_same(ref, run, [("a", [(7 * t) % VOCAB])], last_only=last_only)


@pytest.mark.parametrize("hidden_layer", [0, 1, -1, "last"])
def test_hidden_layer_follows_hf_hidden_states(model, hidden_layer):
    layer = model.config.num_hidden_layers if hidden_layer == "last" else hidden_layer
    ref, run = both(model, ["a", "b"])
    assert_same(ref, run, [("a", [1, 2, 3]), ("b", [4, 5])], hidden_layer=layer)
    assert_same(ref, run, [("a", [6]), ("b", [7, 8, 9])], hidden_layer=layer, last_only=True)


def test_ragged_batches_on_both_read_paths(model):
    sids = [f"s{i}" for i in range(8)]
    ref, run = both(model, sids)
    assert [run._sessions[s].slot for s in sids] == list(range(8))
    for i, request_id in enumerate(sids):  # different lengths in every slot
        assert_same(ref, run, [(request_id, list(range(1, 3 + 5 * i)))])
    paths = record_paths(run)
    batches = [
        ["s0", "s1", "s2", "s3"],  # slots 0-3 of a 4-row view: dense
        ["s5"],  # slot 5 alone: gather one row
        ["s1", "s6"],  # 2 of 8: gather
        ["s0", "s2", "s5", "s6", "s7"],  # 5 of 8: dense, rows 1, 3, 4 idle
        ["s7", "s0", "s3"],  # out of slot order: gather
    ]
    for t, group in enumerate(batches):
        items = [(request_id, [(t + j) % VOCAB] * (1 + (j * 3) % 5)) for j, request_id in enumerate(group)]
        assert_same(ref, run, items, last_only=t % 2 == 1)
    assert paths == [True, False, False, True, False]
    # and the sessions the batches skipped still extend correctly
    assert_same(ref, run, [(request_id, [2, 3]) for request_id in sids])


def test_crop_then_extend_equals_recomputation(model):
    ref, run = ModelRunner(model, "ref"), static(model)
    run.open("a")
    run.extend([("a", list(range(1, 30)))])
    run.crop("a", 12)  # only the length moves: positions 12..28 stay in the slot, hidden by the mask
    got = run.extend([("a", [40, 41, 42])])[0]
    ref.open("fresh")
    expected = ref.extend([("fresh", list(range(1, 13)) + [40, 41, 42])])[0]
    torch.testing.assert_close(got.logits, expected.logits[-3:], **TOL)
    assert run.length("a") == 15


def test_reused_slot_hides_the_previous_session(model):
    run = static(model, slots=2)
    run.open("old")
    run.extend([("old", [5] * 50)])
    run.close("old")
    run.open("new")
    assert run._sessions["new"].slot == 0  # the old session's slot, its 50 keys still there
    got = [run.extend([("new", [1, 2, 3])])[0].logits, run.extend([("new", [4])])[0].logits]
    fresh = static(model, slots=2)
    fresh.open("new")
    expected = [fresh.extend([("new", [1, 2, 3])])[0].logits, fresh.extend([("new", [4])])[0].logits]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert not torch.equal(run.kv.keys[0][0, :, 10], fresh.kv.keys[0][0, :, 10])  # stale keys really remain


def test_full_session_reads_past_the_scratch_column(model):
    """max_len - 1 positions fit; the last length bucket includes the scratch column that
    the padding of a ragged batch writes, and the mask keeps it out of every real query."""
    ref, run = both(model, ["a", "b"], slots=2, max_len=80)
    assert run.length_buckets == (80,)
    assert_same(ref, run, [("a", [i % VOCAB for i in range(1, 70)]), ("b", [3])])
    assert_same(ref, run, [("a", list(range(9, 19))), ("b", [4])])  # a: 79 = max_len - 1 positions
    with pytest.raises(KVCapacityError, match="limit of 79"):
        run.extend([("a", [1])])


def test_slot_budget_and_max_len_errors_change_nothing(model):
    run = static(model, slots=2, max_len=64)
    assert run.kv.slots == 2 and run.kv.capacity == 63
    run.open("a")
    run.open("b")
    with pytest.raises(KVCapacityError, match="kv_budget_tokens=128") as err:
        run.open("c")
    assert isinstance(err.value, RuntimeError)
    assert sorted(run.request_ids()) == ["a", "b"] and run.kv.free_slots == 0
    run.extend([("a", [1] * 60), ("b", [2] * 5)])
    with pytest.raises(KVCapacityError, match="would hold 64 positions"):
        run.extend([("b", [3]), ("a", [4] * 4)])  # b fits, a does not: neither moves
    assert (run.length("a"), run.length("b"), run.forward_passes) == (60, 5, 1)
    run.close("b")
    run.open("c")  # the freed slot
    assert run._sessions["c"].slot == 1


def test_evict_idle_gives_a_new_session_the_least_recently_used_slot(model):
    ref = ModelRunner(model, "ref")
    run = StaticRunner(model, "static", kv_budget_tokens=2 * 64, max_len=64, evict_idle=True)
    for request_id in ("a", "b"):
        ref.open(request_id)
        run.open(request_id)
    assert run.kv.free_slots == 2  # a slot is taken at the first extend, not at open
    assert_same(ref, run, [("a", [1, 2, 3]), ("b", [4, 5])])
    assert_same(ref, run, [("a", [6])])  # b is now the least recently used
    ref.open("c")
    run.open("c")
    slot_of_b = run._sessions["b"].slot
    assert_same(ref, run, [("c", [7, 8])])
    assert not run.has("b") and run.evictions == 1 and run._sessions["c"].slot == slot_of_b
    assert_same(ref, run, [("a", [9]), ("c", [10])])  # the survivors' keys are untouched


def test_evict_idle_refuses_what_no_eviction_can_seat_and_changes_nothing(model):
    run = StaticRunner(model, "static", kv_budget_tokens=2 * 64, max_len=64, evict_idle=True)
    for request_id in ("a", "b", "c"):
        run.open(request_id)
    run.extend([("a", [1, 2])])
    assert not run.kv_fits([("a", 1), ("b", 1), ("c", 1)]) and run.kv_fits([("b", 1), ("c", 1)])
    with pytest.raises(KVCapacityError, match="need 3 of 2 slots"):
        run.extend([("a", [3]), ("b", [4]), ("c", [5])])
    assert run.length("a") == 2 and run.evictions == 0 and run.kv.free_slots == 1
    run.extend([("b", [4]), ("c", [5])])  # a, outside this extend, makes room
    assert not run.has("a") and run.evictions == 1


def test_without_evict_idle_a_full_runner_refuses_at_open(model):
    run = StaticRunner(model, "static", kv_budget_tokens=64, max_len=64)  # M_S: never evicts
    run.open("a")
    with pytest.raises(KVCapacityError, match="no free KV slot"):
        run.open("b")
    assert run.request_ids() == ["a"] and run.evictions == 0


def test_state_after_a_refused_extend_is_intact(model):
    ref, run = both(model, ["a"], slots=1, max_len=64)
    assert_same(ref, run, [("a", list(range(1, 40)))])
    with pytest.raises(KVCapacityError):
        run.extend([("a", [1] * 30)])
    assert_same(ref, run, [("a", [5, 6])])


def test_session_errors_match_model_runner(model):
    run = static(model, slots=2)
    run.open("a")
    with pytest.raises(ValueError, match="already open"):
        run.open("a")
    with pytest.raises(KeyError):
        run.extend([("nope", [1])])
    with pytest.raises(ValueError):
        run.extend([("a", [])])
    with pytest.raises(ValueError):
        run.extend([("a", [1]), ("a", [2])])
    with pytest.raises(ValueError):
        run.crop("a", 3)
    assert run.extend([]) == [] and run.length("a") == 0 and run.kv.free_slots == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: Qwen3ForCausalLM(Qwen3Config(**TINY_SHAPE)),  # q_norm / k_norm
        lambda: GemmaForCausalLM(GemmaConfig(**TINY_SHAPE, head_dim=8)),  # Llama's modules, scaled embeddings
        lambda: MistralForCausalLM(MistralConfig(**TINY_SHAPE, sliding_window=32)),  # a window that binds
    ],
    ids=["qwen3", "gemma", "mistral-window"],
)
def test_unsupported_architectures_raise_value_error(make):
    with pytest.raises(ValueError, match="model_type"):
        StaticRunner(make(), kv_budget_tokens=1024, max_len=128)


# -- the engine over StaticRunners -----------------------------------------------------------
PROMPTS = [(3, 4, 5, 6), (7,), (9, 9, 9, 9, 9, 9, 9, 1)]


def static_engine(models, tokenizer) -> BackoffEngine:
    names = ["small", *[f"medium{i}" for i in range(1, len(models) - 1)], "large"]
    return BackoffEngine([static(m, slots=16, max_len=64, name=n) for m, n in zip(models, names)], tokenizer)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_engine_always_small_and_always_large_are_hf_greedy(pair, tokenizer, prompt):
    engine = static_engine(pair, tokenizer)
    for router, model in (("always-small", pair[0]), ("always-large", pair[1])):
        assert engine.generate(request(prompt, 20, router)).token_ids == hf_greedy(model, prompt, 20)


def test_engine_random_routing_equals_model_runner_engine(pair, tokenizer):
    reqs = [request(p, 16, "random", rate=0.5, seed=s) for p in PROMPTS for s in (1, 2)]
    expected = engine_for(pair, tokenizer).generate_many(reqs)
    engine = static_engine(pair, tokenizer)
    got = engine.generate_many(reqs)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert [g.sources for g in got] == [e.sources for e in expected]
    assert len({g.sources for g in got}) > 1 and all(0 < sum(g.sources) < 16 for g in got)  # really mixed
    assert [m.request_ids() for m in engine.models] == [[], []]
    assert [m.kv.free_slots for m in engine.models] == [16, 16]


@pytest.mark.parametrize("draft_tokens", [1, 3, 5])
def test_engine_speculative_greedy_is_large_alone(pair, tokenizer, draft_tokens):
    reqs = [request(p, 20, "draft", draft_tokens=draft_tokens, verification=Verification.EXACT) for p in PROMPTS]
    engine = static_engine(pair, tokenizer)
    got = engine.generate_many(reqs)
    assert [g.token_ids for g in got] == [hf_greedy(pair[1], p, 20) for p in PROMPTS]
    assert [g.token_ids for g in got] == [e.token_ids for e in engine_for(pair, tokenizer).generate_many(reqs)]
    assert sum(g.rollbacks for g in got) > 0  # crops happened


# -- the graph bookkeeping, replayed eagerly on the CPU -----------------------------------------


def test_graph_replay_bookkeeping_equals_model_runner(model):
    sids = [f"s{i}" for i in range(6)]
    ref, run = both(model, sids, slots=6, max_len=128)
    assert_same(ref, run, [("s0", [1, 2, 3]), ("s4", [4, 5])])  # live sessions before the capture
    run.graphs = EagerGraphs(run._forward, max_rows=4, max_k=16)
    graphs, _ = run.warmup(hidden_layers=(None, 1), progress=False)
    # dense rows 1, 2, 4 and gather rows 1, 2, 4 (max_rows 4); k 1 once, k 2..16 twice; L 128; 2 layers
    assert graphs == 6 * (1 + 4 * 2) * 1 * 2
    assert_same(ref, run, [("s0", [7]), ("s4", [8])])  # the capture wrote scratch columns only
    eager = run.eager_passes
    # the layouts (dense, rows, k) each step's forwards take, at EagerGraphs' default costs
    # (8 a forward + rows x k / 64: fewer forwards first, then fewer token slots)
    steps = [
        ([("s0", [9])], {}, [(True, 1, 1)]),  # one token: the dense view of slot 0
        ([("s4", [1, 2, 3])], dict(last_only=True), [(False, 1, 4)]),  # 4 slots, in as few rows as any
        # counts 1, 2, 7: blocks of 4 (1 + 1 + 2 rows) beat one row each at k 8 (4 x 8 slots)
        ([("s0", [3]), ("s1", [4, 5]), ("s2", [6] * 7)], dict(hidden_layer=1), [(False, 4, 4)]),
        ([("s5", [2] * 9), ("s2", [3])], dict(last_only=True, hidden_layer=1), [(False, 4, 4)]),  # 3 + 1 blocks
        ([("s1", [1] * 40), ("s2", [5])], {}, [(False, 4, 16)]),  # 40 tokens: 3 blocks of 16, one forward
        ([(request_id, [4]) for request_id in sids], {}, [(False, 8, 1)]),  # 8 rows > max_rows: eager
        ([("s0", [5] * 60)], dict(last_only=True), [(False, 4, 16)]),  # 4 blocks of 16
        ([("s0", [6]), ("s3", [7])], dict(hidden_layer=1), [(True, 4, 1)]),  # dense view of 4
        ([("s3", [2] * 70)], dict(hidden_layer=1), [(False, 1, 70)]),  # 5 blocks > 4 rows: eager
    ]
    seen = spy_layouts(run)
    for items, kwargs, layouts in steps:
        del seen[:]
        assert_same(ref, run, items, **kwargs)
        assert seen == layouts, items
    assert run.eager_passes - eager == 2
