"""The meta-device plan of the benchmark pair (benchmarks/gpu_plan.py): the committed
plan.json is what the code computes now, it keeps every model within the graph budget and
the 8B pair within 70 GiB at scripts/gpu_bench.sh's defaults, and it agrees with what the
first H100 run measured (gpu_check.json)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from backoff_core.runners.graph_plan import GRAPH_BUDGET
from benchmarks.gpu_plan import KV_BUDGET, MAX_LEN, plan

RESULTS = Path(__file__).parents[3] / "benchmarks" / "results" / "gpu"


@pytest.fixture(scope="module")
def computed() -> dict:
    return plan()


def test_committed_plan_is_current(computed):
    assert json.loads((RESULTS / "plan.json").read_text()) == computed


def test_plan_fits_the_budgets(computed):
    assert set(computed["models"]) == {"small", "large"}
    for figures in computed["models"].values():
        assert set(figures) >= {"graphs", "kv_gib", "weights_gib", "pool_gib"}
        assert 0 < figures["graphs"] <= GRAPH_BUDGET == 200
    total = sum(m["kv_gib"] + m["weights_gib"] + m["pool_gib"] for m in computed["models"].values())
    assert computed["total_gib"] == pytest.approx(total, abs=1e-3) and total <= 70
    # 64 slots of 1024 positions: 64 streams fit; 8B KV 128 KiB a position -> 8 GiB
    assert computed["models"]["large"]["slots"] == 64 and computed["models"]["large"]["kv_gib"] == 8.0
    assert computed["models"]["large"]["weights_gib"] == pytest.approx(13.75, abs=0.01)


def test_plan_matches_the_gpu_bench_defaults_and_the_measured_run(computed):
    script = (Path(__file__).parents[3] / "scripts" / "gpu_bench.sh").read_text()
    assert re.search(rf"--kv-budget {KV_BUDGET}\b", script) and re.search(rf"--max-len {MAX_LEN}\b", script)
    measured = json.loads((RESULTS / "gpu_check.json").read_text())["measured"]
    for name, figures in computed["models"].items():
        got = measured[name]
        assert got["graphs"] == figures["graphs"]
        assert got["kv_gib"] == figures["kv_gib"] and got["weights_gib"] == pytest.approx(figures["weights_gib"], 1e-3)
        assert 0.5 <= got["pool_gib"] / figures["pool_gib"] <= 1.5  # an estimate, within 50%
