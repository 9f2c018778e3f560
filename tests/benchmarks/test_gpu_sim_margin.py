"""benchmarks/gpu_sim_margin.py: how much dearer a ragged M_L forward may be before the
simulated 64-vs-one ratio falls under the goal. The bisection, the price it starts from, and
the sweep end to end at a small size."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from backoff_core.runners.static_ragged import RAGGED_TOKENS
from benchmarks import gpu_sim_margin
from benchmarks.gpu_costs import GpuCosts
from tests.support.gpu_runs import RUN3


def test_break_even_bisects_to_where_a_falling_ratio_meets_the_goal():
    calls = []

    def at(x):
        calls.append(x)
        return 30 - 10 * x

    assert gpu_sim_margin.break_even(at, 0.0, 4.0, 20.0, steps=20) == pytest.approx(1.0, abs=1e-3)
    assert gpu_sim_margin.break_even(at, 0.0, 0.5, 20.0) is None  # still met at the limit
    assert gpu_sim_margin.break_even(at, 1.5, 4.0, 20.0) == 1.5  # not met even at the start
    assert all(0.0 <= x <= 4.0 for x in calls)


def test_the_price_starts_from_the_probe_where_the_run_timed_the_ragged_graphs():
    costs = GpuCosts.from_results(RUN3)
    assert costs.ragged == {}  # the third run predates the probe: the dense-view estimate
    assert gpu_sim_margin.base_prices(costs) == {t: costs.ragged_ms(t) for t in RAGGED_TOKENS}
    assert gpu_sim_margin.probe_over_estimate(costs) == {}
    probed = dataclasses.replace(costs, ragged={32: 2 * costs.ragged_ms(32)})
    assert gpu_sim_margin.base_prices(probed)[32] == 2 * costs.ragged_ms(32)
    assert gpu_sim_margin.base_prices(probed)[64] == costs.ragged_ms(64)
    assert gpu_sim_margin.probe_over_estimate(probed) == {"32": 2.0}


def test_the_sweep_saves_every_way_and_a_dearer_m_l_scales_less(tmp_path, monkeypatch):
    out = tmp_path / "margin.json"
    argv = ["gpu_sim_margin.py", "--streams", "8", "--tokens", "16", "--seeds", "1", "--steps", "3"]
    monkeypatch.setattr(sys, "argv", argv + ["--goal", "3", "--out", str(out), "--costs", str(RUN3)])
    gpu_sim_margin.main()
    saved = json.loads(out.read_text())
    assert (saved["streams"], saved["tokens"], saved["goal"]) == (8, 16, 3.0)
    assert out.with_suffix(".png").stat().st_size > 0
    priced = saved["as_priced"]["ratio"]
    assert priced > 1  # 8 streams outrun one
    assert set(saved["ways"]) == set(gpu_sim_margin.WAYS)
    for way, row in saved["ways"].items():
        assert set(row["points"]) == {f"{x:g}" for x in gpu_sim_margin.POINTS[way]}
        even = row["break_even"]
        assert even is None or gpu_sim_margin.NEUTRAL[way] <= even <= gpu_sim_margin.LIMIT[way]
    # M_L is a larger share of the time at 8 streams than at one (M_S's steps batch nearly
    # free, M_L's catch-ups cost by the token): M_L dearer as a whole, the ratio falls
    by_factor = [priced] + [cell["ratio"] for cell in saved["ways"]["factor"]["points"].values()]
    assert by_factor == sorted(by_factor, reverse=True) and by_factor[-1] < priced
