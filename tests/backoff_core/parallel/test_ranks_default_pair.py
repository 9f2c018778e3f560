"""The default pair's M_L (SmolLM2-135M: 9 heads, 3 KV heads) over tensor-parallel ranks:
TP=3 (one KV head a rank) equals TP=1 after every catch-up; TP=2 is refused, naming the
model and its head counts. Loads the real pair from the conversion cache."""

from __future__ import annotations

import pytest

from backoff_core.models.default_pair import load_default_pair
from backoff_core.parallel.ranks import parallel_runner
from backoff_core.runners.factory import make_runner

pytestmark = pytest.mark.real_pair
TOL = 1e-4


def test_the_default_large_over_three_ranks_equals_one_and_two_are_refused():
    _, large, _ = load_default_pair()
    with pytest.raises(
        ValueError,
        match=r"large \(llama, 30 layers, hidden 576\): tensor_parallel=2 cannot split its 9 attention heads and 3 KV heads",
    ):
        parallel_runner(large, "large", None, tensor_parallel=2)
    ref, tp = make_runner(large, "large", None), parallel_runner(large, "large", None, tensor_parallel=3)
    try:
        prompt = [1, 504, 3458, 314, 2006, 282, 260, 1812, 30, 378, 1345, 2379, 28, 314, 216, 5, 1115, 17, 25, 33]
        for r in (ref, tp):
            r.open("p")
            r.open("q")
        worst = 0.0
        for items in ([("p", prompt), ("q", prompt[:7])], [("p", [260, 1812])], [("p", [30]), ("q", [28, 314, 216])]):
            for a, b in zip(ref.extend(items), tp.extend(items)):
                worst = max(worst, (a.logits - b.logits).abs().max().item())
        assert worst < TOL
        assert tp.comm.calls == 3 * (2 * 30 + 1)  # per forward: two all-reduces a layer, the head's gather
    finally:
        tp.shutdown()
