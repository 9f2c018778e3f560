"""The compiled decoder layers (backoff_core/runners/static_compiled.py), proven on the CPU in
float32, where inductor compiles C++ as it compiles Triton on a GPU:

- the compiled static forward equals the eager one over every kind of bucket (dense view and
  gathered rows, one and several rows, k = 1 and several, a hidden layer, last logits), and
  HF's own forward;
- one compile serves every bucket of a kind (rows, k and the keys read dynamic): at most one
  a (rows 1 or more, k 1 or more, dense or gathered), and a second model compiles apart, the
  first one's compiles unspoilt;
- the fused weights are views of one buffer (no copy), and HF's forward is unchanged by them;
- a runner with compiled layers decodes exactly HF's greedy tokens, both models of a pair;
- every way to attend computes SDPA's attention, and `auto` (the default) switches at its keys;
- the compiled layer never syncs with the host (capture safety), and its kernel count is held
  (read from inductor's generated code);
- where compiling is on by default, and refused values."""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners import static_compiled
from backoff_core.runners.factory import make_runner
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_compiled import attend, decoder_layer, resolve
from backoff_core.runners.static_forward import StaticForward
from backoff_core.runners.static_kv import StaticKV
from backoff_core.types import KVSpec
from tests.support.helpers import request
from tests.support.host_syncs import HostSyncs
from tests.support.static_batch import MAX_LEN, batch
from tests.support.tiny import tiny_model

IDS = [3, 17, 4, 29, 5, 11, 40, 2, 8, 31, 7, 19]
TOL = dict(atol=2e-5, rtol=2e-5)


# every kind of bucket the runners capture, in an order that writes before it reads
CASES = {
    "prefill, one row, dense": batch([IDS], [0], [0], 16),
    "step, one row, dense": batch([[5]], [12], [0], 16),
    "step, two rows, dense": batch([[6], [7]], [13, 0], [0, 1], 16),
    "step, one row, gathered": batch([[8]], [0], [2], 16),
    "catch-up, two rows, gathered, hidden layer": batch([[1, 2, 3], [4, 5]], [14, 1], [0, 3], 32, hidden_layer=2),
    "k = 2, two rows, dense, last logits": batch([[9, 10], [11, 12]], [17, 3], [0, 1], 32, last_only=True),
}


def forwards(seed: int, hidden: int, layers: int):
    """The same model twice: eager with fused projections (M_S's today), and compiled."""
    eager_model, compiled_model = (
        tiny_model(seed, hidden=hidden, layers=layers),
        tiny_model(seed, hidden=hidden, layers=layers),
    )
    eager = StaticForward(eager_model, StaticKV(eager_model, 4 * MAX_LEN, MAX_LEN), fuse_projections=True)
    compiled = StaticForward(compiled_model, StaticKV(compiled_model, 4 * MAX_LEN, MAX_LEN), compiled=True)
    assert compiled.compiled is not None and eager.compiled is None
    return eager, compiled


@pytest.fixture(scope="module")
def first():
    return forwards(2, 64, 4)


@torch.inference_mode()
def test_compiled_forward_equals_eager_over_every_kind_of_bucket(first):
    eager, compiled = first
    for name, b in CASES.items():
        want, want_hidden = eager(b)
        got, got_hidden = compiled(b)
        torch.testing.assert_close(got, want, **TOL, msg=name)
        assert (got_hidden is None) == (want_hidden is None), name
        if want_hidden is not None:
            torch.testing.assert_close(got_hidden, want_hidden, **TOL, msg=name)
    # the keys and values each wrote are the eager forward's too
    torch.testing.assert_close(compiled.kv.storage, eager.kv.storage, **TOL)
    variants = {(b.input_ids.shape[0] == 1, b.input_ids.shape[1] == 1, b.dense) for b in CASES.values()}
    assert compiled.compiled.compiles == len(variants) == 6


@torch.inference_mode()
def test_a_later_bucket_of_a_kind_reuses_its_compile_and_hf_agrees(first):
    """Four rows over 32 keys and three over 64 ride the two-row step's compile; the logits
    are HF's forward's over the same sequence."""
    eager, compiled = first
    before = compiled.compiled.compiles
    for rows, length in ((4, 32), (3, 64)):
        b = batch([[1]] * rows, [20] * rows, list(range(rows)), length)
        torch.testing.assert_close(compiled(b)[0], eager(b)[0], **TOL)
    assert compiled.compiled.compiles == before
    model = compiled.model
    seq = IDS + [5]  # slot 0's prefill, then its step at 12
    fresh = StaticForward(tiny_model(2, hidden=64, layers=4), StaticKV(model, 2 * MAX_LEN, MAX_LEN), compiled=True)
    logits, _ = fresh(batch([seq], [0], [0], 16))
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(logits[0], ref, **TOL)


@torch.inference_mode()
def test_a_second_model_compiles_apart_and_the_first_keeps_its_compiles(first):
    eager, compiled = first
    other_eager, other = forwards(4, 96, 2)  # another width and depth: other weights' shapes
    b = batch([[6], [7]], [0, 0], [0, 1], 16)
    torch.testing.assert_close(other(b)[0], other_eager(b)[0], **TOL)
    assert other.compiled.compiles == 1
    before = compiled.compiled.compiles
    c = batch([[3], [4]], [21, 20], [0, 1], 32)
    torch.testing.assert_close(compiled(c)[0], eager(c)[0], **TOL)
    assert compiled.compiled.compiles == before


@torch.inference_mode()
def test_fused_weights_are_views_of_one_buffer_and_hf_is_unchanged():
    model = tiny_model(5, hidden=64, layers=2)
    ids = torch.tensor([IDS])
    before = model(ids).logits
    forward = StaticForward(model, StaticKV(model, 2 * MAX_LEN, MAX_LEN), compiled=True)
    assert all(f.shares(layer) for f, layer in zip(forward.fused, model.model.layers))
    assert forward.fused_nbytes() == 0  # no copies held beside the modules
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.v_proj.weight.data_ptr() == forward.fused[0].qkv[-attn.v_proj.weight.shape[0] :].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == forward.fused[0].gate_up[mlp.gate_proj.weight.shape[0] :].data_ptr()
    torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)
    copies = StaticForward(model, StaticKV(model, 2 * MAX_LEN, MAX_LEN), fuse_projections=True)
    assert not copies.fused[0].shares(model.model.layers[0]) and copies.fused_nbytes() > 0


def test_a_compiled_runner_decodes_hf_greedy_tokens(pair, tokenizer):
    """Both models of the pair on static KV with compiled layers, as the factory builds them:
    always-small and always-large are each model's own greedy decoding."""
    kv = KVSpec(4 * 128, 128, compile="on")
    engine = BackoffEngine(
        [make_runner(pair[0], "small", kv, small=True), make_runner(pair[1], "large", kv)], tokenizer
    )
    assert all(m._forward.compiled is not None for m in engine.models)
    prompt = (3, 4, 5, 6)
    for router, model in (("always-small", pair[0]), ("always-large", pair[1])):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert engine.generate(request(prompt, 12, router)).token_ids == tuple(out[0, len(prompt) :].tolist())


@pytest.mark.parametrize("how", ["sdpa", "math", "reduce"])
@pytest.mark.parametrize("name", ["step, two rows, dense", "catch-up, two rows, gathered, hidden layer"])
@torch.inference_mode()
def test_the_compiled_layer_never_syncs_with_the_host(name, how):
    """Capture safety of what inductor compiles: `decoder_layer` dispatches no op that reads a
    value back or sizes an output by data (HostSyncs, as test_capture_safety checks the eager
    step), in every way to attend; fullgraph=True already refuses any graph break."""
    model = tiny_model(12, hidden=64, layers=1)
    forward = StaticForward(model, StaticKV(model, 4 * MAX_LEN, MAX_LEN), compiled=True)
    b = CASES[name]
    h = forward.model.model.embed_tokens(b.input_ids)
    cos, sin = forward._rope_tables(h, b.positions)
    mask = forward.mask(b.positions, b.length, h.dtype)
    args = (h, torch.zeros_like(h), forward.kv.storage[0], b.slots, b.positions, mask, cos, sin)
    with HostSyncs() as trace:
        decoder_layer(*args, *forward._layer_weights(0, model.model.layers[0]), dense=b.dense, attention=how)
    assert trace.syncs == [] and "index_put_" in trace.ops, trace.syncs


def launches(code: str) -> list[str]:
    """The kernels the generated `call` launches: fused kernels, extern GEMMs, attention."""
    body = code[code.index("def call(") :]
    return re.findall(r"^\s+(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|torch\.ops\.aten\.\w+)", body, re.M)


@torch.inference_mode()
def test_a_compiled_layer_launches_nine_kernels():
    """Two GEMMs around the attention, two in the MLP, the attention, and four fused kernels
    (add + norm, rope + the K/V write + q's layout, add + norm, SiLU * up), where the eager
    layer dispatches 19 ops (test_static_forward counts them)."""
    model = tiny_model(6, hidden=64, layers=1)
    forward = StaticForward(model, StaticKV(model, 2 * MAX_LEN, MAX_LEN), compiled=True)
    b = batch([[5], [6]], [3, 4], [0, 1], 16)
    h = torch.randn(2, 1, 64)
    cos, sin = forward._rope_tables(h, b.positions)
    mask = forward.mask(b.positions, b.length, h.dtype).contiguous()
    args = (h, torch.zeros_like(h), forward.kv.storage[0], b.slots, b.positions, mask, cos, sin)
    fn = torch.compile(decoder_layer, fullgraph=True)
    _, codes = run_and_get_code(fn, *args, *forward._layer_weights(0, model.model.layers[0]), dense=True)
    kernels = [k for code in codes for k in launches(code)]
    assert sum(k.startswith("extern_kernels.mm") for k in kernels) == 4, kernels
    assert sum("scaled_dot_product" in k for k in kernels) == 1, kernels
    assert len(kernels) <= 9, kernels


@pytest.mark.parametrize("how", ["math", "reduce"])
def test_every_way_to_attend_is_sdpas_attention(how):
    """attend's ways against SDPA over a causal mask with a padded column, G = 3 folded."""
    torch.manual_seed(8)
    q, keys, values = torch.randn(2, 2, 6, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    positions = torch.tensor([[30, 31], [5, 39]]).repeat(1, 3)  # [B, G*K], (g, k) ordered
    mask = torch.where(torch.arange(40) > positions[..., None], float("-inf"), 0.0)[:, None]
    want = attend(q, keys, values, mask, 0.25, "sdpa")
    torch.testing.assert_close(attend(q, keys, values, mask, 0.25, how), want, **TOL)
    with pytest.raises(ValueError, match="attention must be one of"):
        attend(q, keys, values, mask, 0.25, "quick")


@torch.inference_mode()
def test_auto_attends_by_sdpa_up_to_its_keys_and_by_math_past_them(monkeypatch):
    """The default: SDPA where a forward reads at most SDPA_MAX_KEYS keys, math past them (one
    compile each side), the eager forward's logits either way."""
    monkeypatch.setattr(static_compiled, "SDPA_MAX_KEYS", 16)
    torch.manual_seed(10)
    q, keys, values = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    for length, way in ((16, "sdpa"), (32, "math")):
        k, v, mask = keys[:, :, :length], values[:, :, :length], torch.zeros(1, 1, 3, length)
        assert torch.equal(attend(q, k, v, mask, 0.25, "auto"), attend(q, k, v, mask, 0.25, way))
    model, other = tiny_model(11, hidden=64, layers=2), tiny_model(11, hidden=64, layers=2)
    eager = StaticForward(model, StaticKV(model, 4 * MAX_LEN, MAX_LEN), fuse_projections=True)
    compiled = StaticForward(other, StaticKV(other, 4 * MAX_LEN, MAX_LEN), compiled=True)
    assert compiled.compiled.attention == "auto"
    for b in (batch([[5], [6]], [3, 4], [0, 1], 16), batch([[7], [8]], [4, 5], [0, 1], 32)):
        torch.testing.assert_close(compiled(b)[0], eager(b)[0], **TOL)
    assert compiled.compiled.compiles == 2


@pytest.mark.parametrize("how", ["math", "reduce"])
@torch.inference_mode()
def test_compiled_layers_attending_another_way_equal_eager(how):
    model = tiny_model(9, hidden=64, layers=2)
    eager = StaticForward(model, StaticKV(model, 4 * MAX_LEN, MAX_LEN), fuse_projections=True)
    other = tiny_model(9, hidden=64, layers=2)
    compiled = StaticForward(other, StaticKV(other, 4 * MAX_LEN, MAX_LEN), compiled=True, attention=how)
    assert compiled.compiled.attention == how
    for b in (batch([IDS], [0], [0], 16), batch([[5], [6]], [12, 0], [0, 2], 16)):
        torch.testing.assert_close(compiled(b)[0], eager(b)[0], **TOL)


@pytest.mark.parametrize(
    "mode, device, graphs, want",
    [
        ("auto", "cuda", True, True),
        ("auto", "cuda", False, False),
        ("auto", "cpu", True, False),
        ("on", "cpu", False, True),
        ("off", "cuda", True, False),
    ],
)
def test_where_layers_compile(mode, device, graphs, want):
    assert resolve(mode, torch.device(device), graphs) is want


def test_refused_values_name_the_setting():
    with pytest.raises(ValueError, match="compile must be one of auto, on, off"):
        resolve("sometimes", torch.device("cpu"), True)
    with pytest.raises(ValueError, match="compile must be one of auto, on, off"):
        KVSpec(1024, 256, compile="yes")


def test_a_model_the_compiled_layer_cannot_compute_runs_eager(caplog):
    model = tiny_model(7, hidden=32, layers=1)
    model.config.hidden_act = "gelu"
    run = StaticRunner(model, "gelu", kv_budget_tokens=2 * MAX_LEN, max_len=MAX_LEN, compile_layers=True)
    assert run._forward.compiled is None and "activation 'gelu', not silu" in caplog.text


@pytest.mark.slow  # ten dispatch traces of a whole body: ~25 s on a loaded 2-core machine
@torch.inference_mode()
def test_capture_safety_holds_over_the_compiled_step(first):
    """test_capture_safety's check over the compiled forward: for every kind of bucket the runners
    capture (test_capture_safety.KEYS: M_S's k 1 and 2 with hidden layers, M_L's every k with
    last or full logits, dense and gathered), the body a CUDA graph captures (CudaGraphs._body)
    runs the compiled layers (fullgraph: no graph break, no eager fallback) and gives the eager
    forward's logits (M_L's: the modules' projections); and the same body, its layers the
    function inductor compiles (`decoder_layer`, run as Python: dynamo compiles nothing under a
    dispatch mode), dispatches no op that syncs with the host."""
    from backoff_core.runners.cuda_graphs import CudaGraphs
    from tests.support.capture_keys import KEYS, harmless_inputs

    _, compiled = first
    model = tiny_model(2, hidden=64, layers=4)
    eager = StaticForward(model, StaticKV(model, 4 * MAX_LEN, MAX_LEN))  # M_L's eager forward
    assert eager.fused is None and compiled.kv.max_len == MAX_LEN
    eager.kv.storage.copy_(compiled.kv.storage)  # the keys earlier tests wrote: both read the same
    graphs = {f: CudaGraphs(f, max_rows=4, max_k=16) for f in (compiled, eager)}
    layers, calls = compiled.compiled, []
    # the dispatch trace (slow: ~2 s a body) of one key per (read path, k 1 or more, logits, hidden
    # layer or none): the ops of the glue and of the layers depend on nothing else
    traced = {(k.dense, k.k == 1, k.last_only, k.hidden_layer is None): k for k in KEYS}.values()
    inner = layers._fn
    try:
        for key in KEYS:
            for g in graphs.values():
                harmless_inputs(g, key)
            if key in traced:
                layers._fn = decoder_layer
                with HostSyncs() as trace:
                    graphs[compiled]._body(key)
                assert trace.syncs == [] and "index_put_" in trace.ops, (key, trace.syncs)
            layers._fn = lambda *args, **kwargs: calls.append(1) or inner(*args, **kwargs)
            graphs[compiled]._body(key)
            assert len(calls) == 4, (key, len(calls))  # the compiled function, a call a layer
            del calls[:]
            graphs[eager]._body(key)
            torch.testing.assert_close(graphs[compiled].logits, graphs[eager].logits, **TOL, msg=str(key))
    finally:
        layers._fn = inner
