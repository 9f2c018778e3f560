"""Capture safety, proven on the CPU: for every kind of bucket the runners capture (M_S steps
of k = 1 and 2 with and without a classifier's hidden layer, M_L catch-ups of every k with
last or full logits, each on the dense and the gathered read path), the exact function a
CUDA graph captures (CudaGraphs._body) traces under torch.compile(fullgraph=True) with no
graph break, and a dispatch trace of it holds no op that syncs with the host (reads a
value back, sizes an output by data, indexes with a bool mask, copies across devices).
Either would break a capture on the GPU or silently bake one step's values into it. Both
forwards are checked: the modules' projections (M_L) and the fused ones (M_S)."""

from __future__ import annotations

import functools

import pytest
import torch

from backoff_core.runners.cuda_graphs import CudaGraphs
from backoff_core.runners.graph_plan import K_BUCKETS
from backoff_core.runners.static import StaticRunner
from tests.support.capture_keys import KEYS, MAX_LEN, SLOTS, harmless_inputs
from tests.support.host_syncs import HostSyncs
from tests.support.tiny import tiny_model


@pytest.fixture(scope="module", params=[False, True], ids=["modules", "fused"])
def graphs(request) -> CudaGraphs:
    """The forward with the modules' projections (M_L's) and with fused ones (M_S's)."""
    run = StaticRunner(
        tiny_model(3), "capture", kv_budget_tokens=SLOTS * MAX_LEN, max_len=MAX_LEN, fuse_projections=request.param
    )
    assert (run._forward.fused is not None) == request.param
    return CudaGraphs(run._forward, max_rows=SLOTS, max_k=K_BUCKETS[-1])


def test_every_kind_is_covered():
    """k 1..16 last-logits and 2..16 full-logits catch-ups, M_S's hidden layers, both paths."""
    assert {(k.k, k.last_only) for k in KEYS} == {(1, True)} | {(k, lo) for k in K_BUCKETS[1:] for lo in (True, False)}
    assert {k.hidden_layer for k in KEYS} == {None, 1, 2} and {k.dense for k in KEYS} == {True, False}
    assert len(KEYS) == 2 * (9 + 2 * 2)  # (M_L's 9 kinds + M_S's k 1, 2 at 2 layers) x 2 paths


@pytest.mark.parametrize("key", KEYS, ids=str)
@torch.inference_mode()
def test_captured_body_traces_whole_and_never_syncs(graphs, key):
    harmless_inputs(graphs, key)
    with HostSyncs() as trace:
        graphs._body(key)
    assert trace.syncs == [], (key, trace.syncs)
    assert "scaled_dot_product_attention" in trace.ops or "_scaled_dot_product_flash_attention_for_cpu" in trace.ops
    eager = graphs.logits.clone()
    graphs.logits.zero_()
    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(graphs._body, key), backend="eager", fullgraph=True)
    compiled()  # fullgraph: any graph break raises here
    torch.testing.assert_close(graphs.logits, eager, atol=0, rtol=0)


@torch.inference_mode()
def test_the_checks_can_fail(graphs):
    """A body that reads a value back or masks by data is caught by the dispatch trace, and
    one that branches on a device value by the fullgraph compile."""
    key = KEYS[0]
    harmless_inputs(graphs, key)

    def leaky():
        graphs._body(key)
        n = int(graphs.positions.max())  # a host read
        return graphs.logits[graphs.logits > 0][:n]  # a data-sized output

    with HostSyncs() as trace:
        leaky()
    assert {"item", "_local_scalar_dense"} & set(trace.syncs) and any("bool index" in s for s in trace.syncs)
    torch._dynamo.reset()

    def branchy():  # a Python branch on a device value: a graph break
        graphs._body(key)
        if graphs.positions.max() > 0:
            graphs.logits.zero_()

    with pytest.raises(Exception):  # noqa: B017 - dynamo's error type varies by version
        torch.compile(branchy, backend="eager", fullgraph=True)()
