"""oneDNN linear layers (backoff_core.models.kernels): same outputs as torch's default kernels,
shared modules stay shared, and nothing changes where they do not apply."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import nn
from torch.utils.mkldnn import MkldnnLinear

from backoff_core.models.kernels import model_fingerprint, use_cpu_kernels
from backoff_core.runners.dynamic import ModelRunner
from tests.support.helpers import engine_for, hf_greedy, request
from tests.support.tiny import tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _linears(model: nn.Module) -> tuple[int, int]:
    mods = list(model.modules())
    return sum(type(m) is nn.Linear for m in mods), sum(type(m) is MkldnnLinear for m in mods)


@pytest.mark.parametrize("new_tokens", [1, 2, 3, 8])
def test_converted_model_gives_the_same_logits_after_a_cache(new_tokens):
    dense = tiny_model(5, hidden=64, layers=3, sharpness=4)
    fast = use_cpu_kernels(copy.deepcopy(dense))
    assert _linears(dense)[1] == 0 and _linears(fast) == (0, _linears(dense)[0])
    runners = [ModelRunner(m, name) for m, name in ((dense, "dense"), (fast, "fast"))]
    for r in runners:
        r.open("a")
        r.open("b")
        r.extend([("a", [3, 4, 5, 6, 7]), ("b", [9, 1])])
    # a ragged batch: one row gets `new_tokens` ids, the other one
    items = [("a", list(range(10, 10 + new_tokens))), ("b", [2])]
    out_dense, out_fast = (r.extend(items) for r in runners)
    for d, f in zip(out_dense, out_fast):
        assert d.logits.shape == f.logits.shape
        torch.testing.assert_close(f.logits, d.logits, atol=1e-4, rtol=1e-4)


def test_converted_pair_decodes_like_transformers(tokenizer):
    pair = [
        use_cpu_kernels(tiny_model(1, sharpness=30)),
        use_cpu_kernels(tiny_model(2, hidden=64, layers=4, sharpness=30)),
    ]
    dense_large = tiny_model(2, hidden=64, layers=4, sharpness=30)
    prompt = (3, 4, 5, 6)
    result = engine_for(pair, tokenizer).generate(request(prompt, 20, "always-large"))
    assert result.token_ids == hf_greedy(pair[1], prompt, 20) == hf_greedy(dense_large, prompt, 20)


def test_the_dense_weights_are_let_go():
    model = tiny_model(6)
    weight = weakref.ref(model.model.layers[0].mlp.up_proj.weight)
    use_cpu_kernels(model)
    assert weight() is None  # nothing keeps the float32 copy alive beside oneDNN's


def test_shared_modules_stay_shared_across_calls():
    large, small = tiny_model(1), tiny_model(2)
    small.lm_head = large.lm_head  # M_S shares M_L's LM head, as in the default pair
    use_cpu_kernels(large)
    use_cpu_kernels(small)  # converted later, in another call
    assert isinstance(large.lm_head.linear, MkldnnLinear) and small.lm_head is large.lm_head


def test_no_change_where_it_does_not_apply():
    model = tiny_model(1)
    assert _linears(use_cpu_kernels(model, "default"))[1] == 0
    half = tiny_model(1).to(torch.bfloat16)
    assert _linears(use_cpu_kernels(half))[1] == 0  # oneDNN here is for float32 only
    with pytest.raises(ValueError, match="unknown cpu kernels 'fast'"):
        use_cpu_kernels(model, "fast")


def test_fingerprint_is_the_same_whichever_kernels():
    dense = tiny_model(4)
    assert model_fingerprint(use_cpu_kernels(copy.deepcopy(dense))) == model_fingerprint(dense)


def test_rows_are_padded_to_few_buckets_and_little_past_a_prefills_length():
    from backoff_core.models.kernels import BUCKET_STEP, row_bucket

    assert [row_bucket(m) for m in (1, 2, 3, 5, 9, 200, 256)] == [1, 2, 4, 8, 16, 256, 256]
    assert [row_bucket(m) for m in (257, 512, 513, 2112)] == [512, 512, 768, 2304]
    assert all(m <= row_bucket(m) < m + BUCKET_STEP or row_bucket(m) < 2 * m for m in range(1, 5000))


def test_a_long_prefill_gives_the_dense_logits():
    """A prefill past BUCKET_STEP rows (padded to a multiple of it) equals the dense model's."""
    dense = tiny_model(5, hidden=64, layers=2, sharpness=4)
    fast = use_cpu_kernels(copy.deepcopy(dense))
    ids = torch.tensor([[(7 * i) % 40 + 2 for i in range(300)]])
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, dense(ids).logits, atol=1e-4, rtol=1e-4)
