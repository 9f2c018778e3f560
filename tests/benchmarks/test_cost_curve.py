"""benchmarks/cost_curve.py's figures on the tiny pair: an engine row's generations take the
prompts in turn with its realised routed share, and the goals' ratios against the card's spec
bandwidth (M_L alone over peak, the ideal with every catch-up at M_L's bandwidth floor)."""

from __future__ import annotations

import pytest
import torch

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.types import RoutingParams
from benchmarks.cost_curve import bandwidth_ideal, over_peak, run_engine
from benchmarks.fused_step import spec_bandwidth
from benchmarks.step_overhead import tiny_pair


def test_a_row_takes_the_prompts_in_turn_and_records_its_routed_share():
    torch.manual_seed(0)
    (small, large), tokenizer = tiny_pair()
    engine = BackoffEngine([ModelRunner(small, "small"), ModelRunner(large, "large")], tokenizer)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    seconds, routed, results = run_engine(engine, prompts, 6, RoutingParams(router="random", rate=0.5), 4)
    assert seconds > 0 and len(results) == 4
    sources = [s for r in results for s in r.sources]
    assert len(sources) == 24 and routed == sum(s > 0 for s in sources) / 24
    assert 0 < routed < 1  # 24 coins at 0.5
    for router, share in (("always-large", 1.0), ("always-small", 0.0)):
        assert run_engine(engine, prompts, 4, RoutingParams(router=router), 2)[1] == share


def test_the_bandwidth_ratios():
    """An H200's 4.8 TB/s: 14.76 GB of weights a token in 5.2 ms is 59% of peak; at b=0.9's
    realised 0.1 a token costs c_S + c_r + 0.1 x 3.08 ms at the floor."""
    h200 = spec_bandwidth("NVIDIA H200")
    assert h200 == 4.8e12 and spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12 and spec_bandwidth("cpu") is None
    assert over_peak(14.76e9, h200, 5.2e-3) == pytest.approx(14.76e9 / 4.8e12 / 5.2e-3)
    assert over_peak(14.76e9, None, 5.2e-3) is None
    ideal = bandwidth_ideal(1.1e-3, 14.76e9, h200, {"random b=0.9": 0.1, "M_L alone (always-large)": 1.0})
    assert ideal == {"random b=0.9": pytest.approx(1.1e-3 + 0.1 * 14.76e9 / 4.8e12)}
    assert bandwidth_ideal(1.1e-3, 14.76e9, None, {"random b=0.9": 0.1}) is None
