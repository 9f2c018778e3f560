"""Ragged extends (backoff_core/runners/static_ragged.py) on the CPU: the block mask and the
FlexAttention over the storage read as one sequence equal a per-token reference; a
StaticRunner(ragged=True) gives HF's own logits (ModelRunner) for catch-ups of any shape,
through the eager forward, the graph bookkeeping replayed eagerly and FlexAttention compiled
(as on a GPU); the engine over it generates what plain transformers does; and the body a
CUDA graph captures traces whole with no host sync."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import flex_attention

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.cuda_graphs import CudaGraphs
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.graph_plan import GRAPH_BUDGET, K_BUCKETS, GraphKey
from backoff_core.runners.ragged_reads import far_layout, key_blocks_read
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_ragged import (
    NO_Q_BLOCKS,
    RAGGED_TOKENS,
    RaggedBatch,
    RaggedKey,
    block_mask,
    block_size,
    lay_out_ragged,
    ragged_attention,
)
from tests.support.eager_graphs import EagerGraphs, NoTimeEvent, assert_same
from tests.support.helpers import engine_for, request
from tests.support.host_syncs import HostSyncs
from tests.support.ops import Ops
from tests.support.tiny import tiny_model

PROMPTS = [(1, 5, 9, 2), (3, 3, 7), (8, 1, 4, 4, 6, 2, 9), (2, 6)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(2, hidden=64, layers=4, sharpness=30)  # 4 query heads over 2 kv heads


def ragged_runner(model, slots=8, max_len=128, graphs=False) -> StaticRunner:
    run = StaticRunner(model, "ragged", kv_budget_tokens=slots * max_len, max_len=max_len, ragged=True)
    if graphs:
        run.graphs = EagerGraphs(run._forward, run.graph_max_rows, K_BUCKETS[-1])
        run.warmup(hidden_layers=(None, 1), progress=False)
    return run


def spy_ragged(run) -> list[int]:
    """Record the token bucket of every ragged forward the runner runs."""
    seen, inner = [], run._forward.ragged

    def spy(batch):
        seen.append(batch.input_ids.shape[0])
        return inner(batch)

    run._forward.ragged = spy
    return seen


def assert_serves_padded(model, run) -> None:
    """A catch-up of two sessions gives HF's logits (ModelRunner's) with no ragged forward."""
    ref = ModelRunner(model, "ref")
    for request_id in ("a", "b"):
        ref.open(request_id)
        run.open(request_id)
    seen = spy_ragged(run)
    assert_same(ref, run, [("a", [1, 2, 3]), ("b", [4, 5])], last_only=True)
    assert seen == []


# -- the attention ----------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads, groups, max_len", [(2, 1, 256), (2, 2, 256), (1, 3, 64), (4, 4, 384), (2, 2, 96)])
@torch.inference_mode()
def test_attention_equals_a_per_token_reference(kv_heads, groups, max_len):
    """Tokens in any slots at any positions (two blocks in, one at the first position, the last
    real one), with padding at the scratch column: each sees its own slot's keys up to its
    position and nothing else; a padding token sees the scratch key alone."""
    torch.manual_seed(kv_heads * 10 + groups)
    slots, d, t = 3, 16, 24
    keys, values = torch.randn(slots, kv_heads, max_len, d), torch.randn(slots, kv_heads, max_len, d)
    slot = torch.randint(0, slots, (t,))
    pos = torch.randint(0, max_len - 1, (t,))
    pos[:3] = torch.tensor([0, max_len - 2, min(129, max_len - 2)])
    slot[-4:], pos[-4:] = 0, max_len - 1  # padding
    q = torch.randn(t, kv_heads * groups, d)
    batch = RaggedBatch(torch.zeros(t, dtype=torch.long), pos, slot, torch.zeros(1, dtype=torch.long))
    mask = block_mask(batch, slots, kv_heads, groups, max_len)
    out = ragged_attention(flex_attention, q, keys, values, mask, 0.25).view(t, kv_heads * groups, d)
    for i in range(t):
        s, p = int(slot[i]), int(pos[i])
        for head in range(kv_heads * groups):
            h = head // groups  # HF's order: the G query heads of a kv head are consecutive
            first = p if p == max_len - 1 else 0
            k, v = keys[s, h, first : p + 1], values[s, h, first : p + 1]
            expected = torch.softmax(q[i, head] @ k.T * 0.25, -1) @ v
            torch.testing.assert_close(out[i, head], expected, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_block_mask_lists_only_the_blocks_a_query_block_needs():
    """Hand-written: 2 kv heads, G = 2, 4 slots of 512 keys (4 blocks of 128 each), 64 tokens,
    so a query block of 128 rows is one kv head's 64 tokens. Tokens in slot 1 up to position
    300 (block 2) and in slot 3 at position 5 read those slots' blocks 0-2 and 0; the padding
    reads slot 0's last block; nothing else."""
    t, max_len = 64, 512
    slot = torch.tensor([1] * 20 + [3] * 4 + [0] * 40)
    pos = torch.tensor(list(range(281, 301)) + [2, 3, 4, 5] + [max_len - 1] * 40)
    batch = RaggedBatch(torch.zeros(t, dtype=torch.long), pos, slot, torch.zeros(1, dtype=torch.long))
    mask = block_mask(batch, 4, 2, 2, max_len)
    count, order = mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]
    per = max_len // block_size(max_len)  # 4 blocks per (slot, kv head)
    for head in range(2):  # query block `head` holds kv head `head`'s queries
        expected = {(1 * 2 + head) * per + b for b in range(3)} | {(3 * 2 + head) * per} | {head * per + 3}
        assert set(order[head, : count[head]].tolist()) == expected
    assert count.tolist() == [5, 5]
    assert mask.q_indices is None or not NO_Q_BLOCKS  # the backward's lists: not built


def test_lay_out_ragged_puts_items_end_to_end_and_pads_at_scratch():
    t, (ids, pos, slots, last) = lay_out_ragged([4, 0, 10], [2, 5, 0], [[7, 8], [9], [1, 2, 3]], scratch=63, rows=4)
    assert t == RAGGED_TOKENS[0]  # 6 tokens: the smallest bucket
    assert ids[:6].tolist() == [7, 8, 9, 1, 2, 3] and pos[:6].tolist() == [4, 5, 0, 10, 11, 12]
    assert slots[:6].tolist() == [2, 2, 5, 0, 0, 0] and last.tolist() == [1, 2, 5, 0]
    assert (pos[6:] == 63).all() and (slots[6:] == 0).all() and len(ids) == len(pos) == len(slots) == t


# -- the runner -------------------------------------------------------------------------------


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph bookkeeping"])
def test_catch_ups_equal_model_runner(model, graphs):
    """Prompts, then catch-ups of 1 to 70 tokens over non-adjacent slots, crossing the 64 and
    128 positions (two blocks of a slot in one forward): HF's logits, and the sessions carry on.
    Steps (one token each), full logits and hidden layers keep the padded path."""
    sids = [f"s{i}" for i in range(6)]
    ref, run = ModelRunner(model, "ref"), ragged_runner(model, graphs=graphs)
    for request_id in sids:
        ref.open(request_id)
        run.open(request_id)
    seen = spy_ragged(run)
    assert_same(ref, run, [(r, list(range(1, 3 + 5 * i))) for i, r in enumerate(sids)], last_only=True)
    assert_same(ref, run, [("s4", [5, 6, 7]), ("s1", [9]), ("s5", [3] * 70)], last_only=True)
    assert_same(ref, run, [("s2", list(range(2, 40))), ("s0", [4, 4])], last_only=True)
    assert seen == [128, 128, 64]  # 87, 74 and 40 tokens
    del seen[:]
    assert_same(ref, run, [(r, [4]) for r in sids], last_only=True)  # a step
    assert_same(ref, run, [("s0", [5, 8]), ("s3", [1])])  # full logits
    assert_same(ref, run, [("s0", [5, 8])], last_only=True, hidden_layer=1)
    assert seen == []
    assert_same(ref, run, [("s5", [1, 2])], last_only=True)  # the slot the steps moved on
    assert seen == [32]
    del seen[:]
    # with graphs, past the largest bucket their buffers hold (8 rows x 16: 128 tokens): runs of
    # items, a forward each; eager, every bucket up to 1024
    assert_same(ref, run, [("s2", [6] * 60), ("s3", [7] * 60), ("s4", [8] * 30)], last_only=True)
    assert seen == ([128, 32] if graphs else [192])
    assert run.eager_passes == (0 if graphs else run.forward_passes)


@pytest.mark.slow  # captures every bucket's ragged graph (FlexAttention traced each time): ~15 s
def test_the_graph_set_holds_one_per_bucket_within_the_budget(model):
    run = ragged_runner(model, slots=64, max_len=128, graphs=True)
    keys = set(run.graphs._graphs)
    assert {k for k in keys if isinstance(k, RaggedKey)} == {RaggedKey(t) for t in RAGGED_TOKENS}
    assert len(keys) <= GRAPH_BUDGET
    assert set(run.graphs.ms) == keys  # every replay timed, the ragged ones too


def test_a_failed_ragged_capture_at_warmup_leaves_the_padded_path_serving(model, caplog):
    """warmup with ragged set: if the ragged graphs fail (a first FlexAttention compile on a new
    device), the padded graphs stay, ragged goes off with a warning, and extends are HF's."""
    run = StaticRunner(model, "large", kv_budget_tokens=8 * 128, max_len=128, ragged=True)
    run.graphs = EagerGraphs(run._forward, run.graph_max_rows, K_BUCKETS[-1])
    body = run.graphs._body

    def failing(key):
        if isinstance(key, RaggedKey) and key.tokens == 64:
            raise RuntimeError("triton compile failed")
        body(key)

    run.graphs._body = failing
    with caplog.at_level("WARNING", logger="backoff_core.runners.static_ragged"):
        graphs, _ = run.warmup(progress=False)
    assert run.ragged is False and "ragged catch-ups off" in caplog.text
    assert graphs == len(run.graphs) > 0 and not any(isinstance(k, RaggedKey) for k in run.graphs.ms)
    assert_serves_padded(model, run)
    assert run.eager_passes == 0


def test_a_ragged_forward_that_computes_wrong_is_turned_off_at_warmup(model, caplog):
    """Warm-up checks a catch-up ragged against padded (StaticRunner.ragged_rel_err): a kernel
    that compiles and captures but computes wrong (here its logits negated) turns ragged off
    with a warning naming the error, and leaves no session, pass or graph of it behind."""
    run = StaticRunner(model, "large", kv_budget_tokens=8 * 128, max_len=128, ragged=True, ragged_if_faster=True)
    run.graphs = EagerGraphs(run._forward, run.graph_max_rows, K_BUCKETS[-1])
    inner = run._forward.ragged
    run._forward.ragged = lambda batch: -inner(batch)
    with caplog.at_level("WARNING", logger="backoff_core.runners.static_ragged"):
        run.warmup(progress=False)
    assert run.ragged is False and "ragged catch-ups off" in caplog.text and "from the padded path's" in caplog.text
    assert run.request_ids() == [] and run.forward_passes == run.eager_passes == 0
    assert not any(isinstance(k, RaggedKey) for k in run.graphs.ms)
    assert_serves_padded(model, run)


def test_a_right_ragged_forward_passes_warmups_check(model):
    run = ragged_runner(model, graphs=True)
    seen = spy_ragged(run)
    assert run.ragged and run.ragged_rel_err() < 1e-5 and seen  # float32: the padded path's logits
    assert run.request_ids() == [] and run.forward_passes == 0


def test_warmups_check_reads_past_a_slots_first_key_block(model):
    """At a real max_len the check's prompts fill several key blocks of their slots (up to
    half a slot each), so its ragged catch-up reads a slot's later blocks and cuts causally
    inside one, as long contexts do; HF's logits there too (float32)."""
    run = ragged_runner(model, slots=6, max_len=768)
    furthest, inner = [], run._forward.ragged

    def spy(batch):
        real = batch.positions < run.kv.scratch
        furthest.append(int(batch.positions[real].max()))
        return inner(batch)

    run._forward.ragged = spy
    assert run.ragged_rel_err() < 1e-5
    catch_up = furthest[-1]  # the prompts' forward, then the catch-up's
    assert catch_up >= 300 + 9 - 1 and catch_up // block_size(768) >= 2  # block 2 of a slot
    assert run.request_ids() == []


def test_a_check_with_no_ragged_forward_to_run_fails(model, caplog):
    """Warm-up's check must run its catch-up ragged: where it would not (a bucket missing), it
    fails rather than compare the padded path with itself, and ragged goes off."""
    run = StaticRunner(model, "large", kv_budget_tokens=8 * 128, max_len=128, ragged=True)
    run.graphs = EagerGraphs(run._forward, run.graph_max_rows, K_BUCKETS[-1])
    run._ragged_runs = lambda *args: None
    with caplog.at_level("WARNING", logger="backoff_core.runners.static_ragged"):
        run.warmup(progress=False)
    assert run.ragged is False and "no ragged forward to run" in caplog.text


# 8 slots x 128: 8 row buckets x one length a kind, 9 kinds (72 graphs); ragged: 3 buckets
TIGHT = 74


def kinds_captured(run) -> set[tuple[int, bool]]:
    return {(k.k, k.last_only) for k in run.graphs.ms if isinstance(k, GraphKey)}


def test_a_tight_budget_gives_ragged_graphs_the_long_last_logits_kind_and_takes_it_back(model, caplog):
    """Within a budget that holds every padded kind but not the ragged graphs too, warmup drops
    the k = 16 last-logits kind (graph_plan.kinds(ragged=True)); where ragged then goes off
    (its check fails here: logits negated), that kind is captured after all, as a runner
    without ragged catch-ups has it; capture_padded does the same on demand."""
    padded = StaticRunner(model, "large", kv_budget_tokens=8 * 128, max_len=128)
    padded.graphs = EagerGraphs(padded._forward, padded.graph_max_rows, K_BUCKETS[-1])
    padded.warmup(progress=False, budget=TIGHT)
    assert (16, True) in kinds_captured(padded) and len(padded.graphs) == 72

    run = ragged_runner(model, graphs=False)
    run.graphs = EagerGraphs(run._forward, run.graph_max_rows, K_BUCKETS[-1])
    run.warmup(progress=False, budget=TIGHT)
    assert run.ragged and (16, True) not in kinds_captured(run) and len(run.graphs) == 64 + 3
    run.ragged = False
    assert run.capture_padded() >= 0 and kinds_captured(run) == kinds_captured(padded)
    assert run._ks(True, None) == padded._ks(True, None) == K_BUCKETS

    wrong = StaticRunner(model, "large", kv_budget_tokens=8 * 128, max_len=128, ragged=True, ragged_if_faster=True)
    wrong.graphs = EagerGraphs(wrong._forward, wrong.graph_max_rows, K_BUCKETS[-1])
    inner = wrong._forward.ragged
    wrong._forward.ragged = lambda batch: -inner(batch)
    with caplog.at_level("WARNING", logger="backoff_core.runners.static_ragged"):
        wrong.warmup(progress=False, budget=TIGHT)
    assert wrong.ragged is False and kinds_captured(wrong) == kinds_captured(padded)
    assert set(wrong.graphs.ms) == set(padded.graphs.ms)


def auto_runner(model, cost):
    """ragged_if_faster (KVSpec ragged "auto") over graphs timed by `cost(key)`, with three sessions."""
    run = StaticRunner(model, "large", kv_budget_tokens=8 * 128, max_len=128, ragged=True, ragged_if_faster=True)
    run.graphs = EagerGraphs(run._forward, run.graph_max_rows, K_BUCKETS[-1], cost=cost)
    run.warmup(progress=False)
    ref = ModelRunner(model, "ref")
    for request_id, prompt in zip("abc", PROMPTS):
        for r in (ref, run):
            r.open(request_id)
            r.extend([(request_id, list(prompt))], last_only=True)
    return run, ref


CATCH_UP = [("a", [1, 2, 3]), ("b", [4] * 12), ("c", [5, 6])]  # 17 tokens: a 32-token ragged forward


@pytest.mark.parametrize(
    "ragged_ms, takes",
    [(0.5, True), (2.0, False), (1.0, False)],
    ids=["ragged faster", "padded faster", "a tie keeps padded"],
)
def test_auto_takes_ragged_where_its_replays_were_timed_faster(model, ragged_ms, takes):
    """KVSpec ragged "auto": a catch-up runs ragged only where its ragged forwards' measured
    replays sum to less than the padded layout's (static_layout.choose's cost); a step or full
    logits never; either way HF's logits."""
    run, ref = auto_runner(model, lambda key: ragged_ms if isinstance(key, RaggedKey) else 1.0)
    seen = spy_ragged(run)
    assert_same(ref, run, CATCH_UP, last_only=True)
    assert seen == ([32] if takes else [])
    assert_same(ref, run, [("a", [7]), ("b", [8]), ("c", [9])], last_only=True)  # a step
    assert_same(ref, run, [("a", [1, 2])])  # full logits
    assert seen == ([32] if takes else []) and run.eager_passes == 0


def test_auto_takes_ragged_where_the_padded_path_has_no_graph(model):
    """A catch-up whose padded layout has no captured graph (an eager forward: inf) runs ragged
    however slow its replay was timed; without graphs (nothing timed) auto keeps padded."""
    run, ref = auto_runner(model, lambda key: 100.0 if isinstance(key, RaggedKey) else 1.0)
    for key in [k for k in run.graphs.ms if isinstance(k, GraphKey)]:
        del run.graphs.ms[key]  # untimed: choose finds no layout
    seen = spy_ragged(run)
    assert_same(ref, run, CATCH_UP, last_only=True)
    assert seen == [32] and run.eager_passes == 0

    untimed = StaticRunner(model, "large", kv_budget_tokens=4 * 64, max_len=64, ragged=True, ragged_if_faster=True)
    assert_serves_padded(model, untimed)


def test_past_the_largest_bucket_runs_of_items_each_take_a_forward(model):
    """Items end to end past the largest bucket: runs of consecutive items, a ragged forward
    each, HF's logits for all. An item longer than the largest bucket, or more items than the
    forward's output rows, keep the padded path."""
    run = ragged_runner(model, slots=2, max_len=2048)
    ref = ModelRunner(model, "ref")
    for request_id in ("a", "b"):
        ref.open(request_id)
        run.open(request_id)
    seen = spy_ragged(run)
    assert_same(ref, run, [("a", [1, 2] * 300), ("b", [2] * 500)], last_only=True)  # 1100 tokens
    assert seen == [768, 512]  # 600 | 500
    del seen[:]
    assert_same(ref, run, [("a", [3] * 1100), ("b", [4, 5])], last_only=True)  # 1100 > 1024 in one item
    assert seen == []
    run.graph_max_rows = 1  # more items than the forward's output rows
    assert_same(ref, run, [("a", [3, 4]), ("b", [5, 6])], last_only=True)
    assert seen == []
    run.graph_max_rows = 2
    assert_same(ref, run, [("a", [3, 4]), ("b", [5, 6])], last_only=True)
    assert seen == [32]


@torch.inference_mode()
def test_flex_attention_compiled_equals_model_runner(model):
    """FlexAttention compiled (inductor; Triton on a GPU, C++ here) over the same block mask:
    HF's logits, and one compile serves every forward of a token bucket (a new mask each)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ref, run = ModelRunner(model, "ref"), ragged_runner(model, slots=4)
    run._forward._flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    for request_id in ("a", "b", "c"):
        ref.open(request_id)
        run.open(request_id)
    assert_same(ref, run, [("a", list(range(1, 9))), ("b", list(range(2, 20))), ("c", [3, 4])], last_only=True)
    assert_same(ref, run, [("a", [5, 6]), ("c", list(range(1, 12)))], last_only=True)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow  # inductor compiles three buckets
@torch.inference_mode()
def test_without_graphs_warmup_compiles_every_bucket_and_catch_ups_compile_nothing(model):
    """cuda_graphs off (graphs None) with a compiled attention: warmup runs one ragged forward a
    bucket up to the storage's capacity (2 slots x 64: buckets 32-128), so the compiles happen
    there; catch-ups after it compile nothing and give HF's logits. The eager attention (the
    CPU's default) has nothing to compile: no forward."""
    from torch._dynamo.utils import counters

    eager = StaticRunner(model, "eager", kv_budget_tokens=2 * 64, max_len=64, ragged=True)
    seen = spy_ragged(eager)
    assert eager.warmup(progress=False) == (0, 0.0) and seen == [] and eager.ragged

    torch._dynamo.reset()
    counters.clear()
    run = StaticRunner(model, "ragged", kv_budget_tokens=2 * 64, max_len=64, ragged=True)
    run._forward._flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    seen = spy_ragged(run)
    graphs, seconds = run.warmup(progress=False)
    # a forward a bucket, then warm-up's check: two sessions' prompts (62 tokens), a catch-up of 11
    assert (graphs, seen) == (0, [32, 64, 128, 64, 32]) and seconds > 0 and run.ragged
    assert run.forward_passes == 0 and run.request_ids() == []  # the check leaves no trace
    compiled = counters["stats"]["unique_graphs"]
    assert compiled == 3
    ref = ModelRunner(model, "ref")
    for request_id in ("a", "b"):
        ref.open(request_id)
        run.open(request_id)
    assert_same(ref, run, [("a", list(range(1, 9))), ("b", list(range(2, 40)))], last_only=True)  # 46: 64
    assert_same(ref, run, [("a", [5, 6]), ("b", [7])], last_only=True)  # 3: 32
    assert seen[5:] == [64, 32] and counters["stats"]["unique_graphs"] == compiled


def test_a_failed_compile_at_warmup_without_graphs_leaves_the_padded_path_serving(model, caplog):
    """Without graphs, an attention whose compile fails at warmup turns ragged off with a
    warning; extends then take the padded path, with HF's logits."""

    def failing(*args, **kwargs):
        raise RuntimeError("triton compile failed")

    run = StaticRunner(model, "large", kv_budget_tokens=2 * 64, max_len=64, ragged=True)
    run._forward._flex = failing
    with caplog.at_level("WARNING", logger="backoff_core.runners.static_ragged"):
        assert run.warmup(progress=False) == (0, 0.0)
    assert run.ragged is False and "ragged catch-ups off" in caplog.text
    assert_serves_padded(model, run)


# -- capture safety ---------------------------------------------------------------------------


@pytest.mark.parametrize("fuse", [False, True], ids=["modules", "fused"])
@torch.inference_mode()
def test_captured_body_traces_whole_and_never_syncs(fuse, monkeypatch):
    """CudaGraphs._body of a ragged key, on the inputs a capture writes: no host-sync op in a
    dispatch trace (the block mask's construction included), FlexAttention dispatched, and
    torch.compile(fullgraph=True) traces it with no graph break, to the same logits."""
    run = StaticRunner(tiny_model(3), "c", kv_budget_tokens=4 * 64, max_len=64, fuse_projections=fuse, ragged=True)
    graphs = EagerGraphs(run._forward, 4, K_BUCKETS[-1])
    key = RaggedKey(RAGGED_TOKENS[0])
    graphs.positions.fill_(run.kv.scratch)
    graphs.token_slots.zero_()
    graphs.last_col.zero_()
    with monkeypatch.context() as patch:  # eager flex compiles itself; the trace wants the op
        patch.setattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
        with HostSyncs() as trace:
            graphs._body(key)
    assert trace.syncs == [] and "flex_attention" in trace.ops
    eager = graphs.logits.clone()
    graphs.logits.zero_()
    torch._dynamo.reset()
    torch.compile(functools.partial(graphs._body, key), backend="eager", fullgraph=True)()
    torch.testing.assert_close(graphs.logits, eager, atol=0, rtol=0)


@torch.inference_mode()
def test_a_ragged_forward_launches_what_a_dense_view_does_a_layer_and_its_mask_once(monkeypatch):
    """The ops a captured body dispatches that make a tensor (a kernel each on a GPU), counted
    at 2 and 4 layers: a ragged forward's layer is a dense view's (FlexAttention in SDPA's
    place, one kernel), and its block mask is built once a forward, in at most 32 ops more
    than the dense view's fixed part (~0.1 ms at the H100's ~2.5 µs a kernel). The simulator
    prices a ragged forward at the dense view's replay; gpu_sim_margin.py finds the goal kept
    up to ~15 ms more a forward, but only ~1.19x the whole or ~3.6 µs a token: a mask rebuilt
    in every layer would be the cost that scales."""
    monkeypatch.setattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    counts = {}
    for layers in (2, 4):
        run = StaticRunner(
            tiny_model(3, hidden=96, layers=layers), "c", kv_budget_tokens=8 * 256, max_len=256, ragged=True
        )
        graphs = EagerGraphs(run._forward, 8, K_BUCKETS[-1])
        graphs.positions.fill_(run.kv.scratch)
        graphs.token_slots.zero_()
        graphs.last_col.zero_()
        for name, key in (("ragged", RaggedKey(RAGGED_TOKENS[0])), ("dense", GraphKey(True, 8, 4, 256, True, None))):
            with Ops() as ops:
                graphs._body(key)
            counts[name, layers] = ops.count
    per_layer = {name: (counts[name, 4] - counts[name, 2]) / 2 for name in ("ragged", "dense")}
    fixed = {name: counts[name, 2] - 2 * per_layer[name] for name in ("ragged", "dense")}
    assert per_layer["ragged"] == per_layer["dense"]
    assert 0 < fixed["ragged"] - fixed["dense"] <= 32


# -- the engine -------------------------------------------------------------------------------


def test_engine_over_ragged_catch_ups_equals_model_runner_engine(pair, tokenizer):
    """Random routing (catch-ups of several tokens, held and batched): the same tokens and
    sources as the engine over ModelRunners, with the catch-ups really ragged."""
    reqs = [request(p, 16, "random", rate=0.5, seed=s) for p in PROMPTS for s in (1, 2)]
    expected = engine_for(pair, tokenizer).generate_many(reqs)
    small = StaticRunner(pair[0], "small", kv_budget_tokens=16 * 64, max_len=64)
    large = StaticRunner(pair[1], "large", kv_budget_tokens=16 * 64, max_len=64, ragged=True)
    seen = spy_ragged(large)
    got = BackoffEngine([small, large], tokenizer).generate_many(reqs)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert [g.sources for g in got] == [e.sources for e in expected]
    assert len(seen) > 1 and np.mean(seen) >= RAGGED_TOKENS[0]
    assert large.kv.free_slots == 16


# -- pricing a ragged forward by the key blocks it reads ----------------------------------------


def test_key_blocks_read_by_hand():
    """G = 4, blocks of 128: a query block holds 32 tokens. Per query block, each slot read
    counts its blocks up to its furthest position; the most of any query block."""
    # tokens 0-9: slot 2 at 300-309 (blocks 0-2: 3); 10-31: slot 5 at 0-21 (1): query block 0 reads 4
    # tokens 32-41: slot 7 at 130-139 (2): query block 1 reads 2
    positions = np.r_[300:310, 0:22, 130:140]
    slots = np.r_[[2] * 10, [5] * 22, [7] * 10]
    assert key_blocks_read(positions, slots, groups=4, block=128) == 4
    # one item across two query blocks: each reads its own furthest position's blocks
    assert key_blocks_read(np.r_[100:140], np.full(40, 1), groups=4, block=128) == 2
    # G = 3: token 42's rows 126-128 span query blocks 0 and 1; its slot counts in both
    positions, slots = np.r_[0:43], np.r_[[0] * 42, [3]]
    assert key_blocks_read(positions, slots, groups=3, block=128) == 2
    assert key_blocks_read(np.r_[0:42, 500], slots, groups=3, block=128) == 1 + 4
    # the far layout: 32 tokens a query block, each in another free slot, every block of each
    positions, slots = far_layout(64, free=range(40), max_len=512)
    assert (positions == 510).all() and list(slots[:3]) == [0, 1, 2] and slots[40] == 0
    assert key_blocks_read(positions, slots, groups=4, block=128) == 32 * 4
    assert key_blocks_read(*far_layout(64, free=[3, 5], max_len=512), groups=4, block=128) == 2 * 4


@pytest.mark.parametrize("kv_heads, groups, max_len", [(2, 4, 512), (1, 2, 256), (4, 1, 384)])
def test_key_blocks_read_is_the_block_masks_longest_row(kv_heads, groups, max_len):
    """What the host counts is what the device's block mask lists: the most key blocks of any
    of its query blocks (kv_num_blocks), over random catch-ups that fill a token bucket."""
    rng = np.random.default_rng(kv_heads * groups)
    slots_n, t = 6, 128
    for _ in range(20):
        counts = rng.multinomial(t, np.ones(5) / 5)
        counts = counts[counts > 0]
        held = rng.integers(0, max_len - 1 - counts, size=len(counts))
        slot_of = rng.choice(slots_n, size=len(counts), replace=False)
        _, (ids, positions, token_slots, last) = lay_out_ragged(
            held, slot_of, [[1] * c for c in counts], max_len - 1, 8
        )
        mask = block_mask(RaggedBatch(ids, positions, token_slots, last), slots_n, kv_heads, groups, max_len)
        block = block_size(max_len)
        assert key_blocks_read(positions.numpy(), token_slots.numpy(), groups, block) == int(mask.kv_num_blocks.max())


def test_ragged_graphs_are_timed_far_over_free_slots_only(model, monkeypatch):
    """Warm-up times each ragged graph twice: as captured (one key block a query block) and
    laid out far over the free slots, with the key blocks read there; a far replay after load
    (capture_ragged beside live sessions) writes only slots no session holds."""
    run = StaticRunner(model, "large", kv_budget_tokens=6 * 256, max_len=256, ragged=True, ragged_if_faster=True)
    run.graphs = EagerGraphs(run._forward, run.graph_max_rows, K_BUCKETS[-1])
    run.warmup(progress=False)
    ragged = [k for k in run.graphs.ms if isinstance(k, RaggedKey)]
    assert ragged and set(run.graphs.far) == set(ragged)
    g = run._forward.groups  # 2: 64 tokens a query block, 6 slots of two blocks each
    assert {key: read for key, (read, _) in run.graphs.far.items()} == {key: 6 * 2 for key in ragged}
    assert [t for t in run.graphs.timed if isinstance(t, tuple)] == [(key, "far") for key in ragged]

    for request_id, prompt in zip("ab", PROMPTS):
        run.open(request_id)
        run.extend([(request_id, list(prompt) * 40)], last_only=True)  # past the first block
    live = [run._sessions[r].slot for r in "ab"]
    before = [(k[live].clone(), v[live].clone()) for k, v in zip(run.kv.keys, run.kv.values)]
    monkeypatch.setattr(torch.cuda, "Event", NoTimeEvent)
    free = run.kv.free_slot_ids()
    assert not set(free) & set(live) and g == 2
    CudaGraphs.replay_ms(run.graphs, RaggedKey(64), far=free)  # the real replay_ms, the body run eagerly
    for (k, v), (k0, v0) in zip(zip(run.kv.keys, run.kv.values), before):
        assert torch.equal(k[live], k0) and torch.equal(v[live], v0)
    assert run.kv.keys[0][free, :, 254].abs().sum() > 0  # the far column of free slots was written


def test_auto_prices_a_ragged_forward_by_the_key_blocks_it_reads(model):
    """`auto` over ragged graphs cheap as timed near (0.5 ms against the padded 1.0) but dear
    far: a catch-up whose query blocks read few key blocks runs ragged; one over long contexts
    in several slots, whose query block reads many, runs padded. HF's logits either way."""
    cheap_near = lambda key: 0.5 if isinstance(key, RaggedKey) else 1.0  # noqa: E731
    run = StaticRunner(model, "large", kv_budget_tokens=6 * 512, max_len=512, ragged=True, ragged_if_faster=True)
    run.graphs = EagerGraphs(run._forward, run.graph_max_rows, K_BUCKETS[-1], cost=cheap_near, far_cost=lambda key: 5.0)
    run.warmup(progress=False)
    ref = ModelRunner(model, "ref")
    for request_id, n in zip("abcd", (3, 300, 400, 5)):
        for r in (ref, run):
            r.open(request_id)
            r.extend([(request_id, [(3 * j + 1) % 40 for j in range(n)])], last_only=True)
    seen, eager = spy_ragged(run), run.eager_passes  # the long prompts ran eagerly
    far_read = run.graphs.far[RaggedKey(32)][0]
    assert far_read == 6 * 4  # G = 2: 64 tokens a query block over 6 slots of 4 blocks

    def priced(items) -> float:
        new_ids = [ids for _, ids in items]
        (only,) = run._ragged_runs(new_ids, None, True)
        return run._ragged_ms(only, [run._sessions[r] for r, _ in items], new_ids)

    short = [("a", [1, 2, 3]), ("d", [4, 5])]  # a block of each of two slots
    assert priced(short) == pytest.approx(0.5 + 4.5 * (2 - 1) / (far_read - 1))  # under the padded 1.0
    assert_same(ref, run, short, last_only=True)
    assert seen == [32]
    long = [("b", [1, 2, 3]), ("c", [4, 5]), ("a", [6])]  # blocks 0-2 and 0-3 of two slots, 0 of a third
    assert priced(long) == pytest.approx(0.5 + 4.5 * (3 + 4 + 1 - 1) / (far_read - 1))  # over 1.0
    assert_same(ref, run, long, last_only=True)
    assert seen == [32] and run.eager_passes == eager
