"""The meta-device plan of the benchmark pair (benchmarks/gpu_plan.py): the committed
plan.json is what the code computes now, it keeps every model within the graph budget and
the 8B pair within 70 GiB at scripts/gpu_bench.sh's defaults, and it agrees with what the
first H100 run measured (gpu_check.json)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from backoff_core.runners.graph_plan import GRAPH_BUDGET, K_BUCKETS, kinds, length_buckets, plan_keys, row_buckets
from backoff_core.runners.static_ragged import RAGGED_TOKENS
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
    total = sum(m["kv_gib"] + m["weights_gib"] + m["pool_gib"] + m["fused_gib"] for m in computed["models"].values())
    assert computed["total_gib"] == pytest.approx(total, abs=1e-3) and total <= 70
    # 64 slots of 1024 positions: 64 streams fit; 8B KV 128 KiB a position -> 8 GiB
    assert computed["models"]["large"]["slots"] == 64 and computed["models"]["large"]["kv_gib"] == 8.0
    assert computed["models"]["large"]["weights_gib"] == pytest.approx(13.75, abs=0.01)
    # M_S's fused copies: per layer q/k/v [576 + 2 * 192, 576] and gate/up [2 * 1536, 576] in bf16
    assert computed["models"]["small"]["fused_gib"] == round(30 * (960 + 3072) * 576 * 2 / 2**30, 3) == 0.13
    assert computed["models"]["large"]["fused_gib"] == 0  # M_L keeps its modules
    # M_L's ragged catch-ups (KVSpec ragged "auto", the default on CUDA): every token bucket, in the budget
    assert computed["models"]["large"]["ragged_graphs"] == len(RAGGED_TOKENS)
    assert computed["models"]["small"]["ragged_graphs"] == 0


def test_plan_matches_the_gpu_bench_defaults_and_the_measured_run(computed):
    """The last GPU run measured the plan of its own code (gpu_check.json's "plan"): the
    estimator is held to that run; the committed plan.json is the current code's."""
    script = (Path(__file__).parents[3] / "scripts" / "gpu_bench.sh").read_text()
    assert re.search(rf'--kv-budget "\$\{{KV_BUDGET:-{KV_BUDGET}\}}"', script)  # the default, unless overridden
    assert re.search(rf'--max-len "\$\{{MAX_LEN:-{MAX_LEN}\}}"', script)
    check = json.loads((RESULTS / "gpu_check.json").read_text())
    measured = check["measured"]
    for name, figures in check["plan"].items():
        got = measured[name]
        assert got["graphs"] == figures["graphs"]
        assert got["kv_gib"] == figures["kv_gib"] and got["weights_gib"] == pytest.approx(figures["weights_gib"], 1e-3)
        assert 0.5 <= got["pool_gib"] / figures["pool_gib"] <= 1.5  # an estimate, within 50%
        if "fused_gib" in got:  # runs before the fused projections did not have them
            assert got["fused_gib"] == pytest.approx(figures["fused_gib"], abs=1e-3)


def test_graph_budget_takes_whole_kinds_in_priority_order():
    wanted = kinds((None,), (True, False), K_BUCKETS)
    assert [(k.k, k.last_only) for k in wanted] == [(1, True), (2, True), (4, True), (8, True), (16, True)] + [
        (4, False),
        (8, False),
        (2, False),
        (16, False),
    ]
    # 64 slots: dense rows 1..64 (7) and gathered 1..64 (7: an extend's blocks); L 256, 1024
    assert row_buckets(64, 64) == [(True, 2**i) for i in range(7)] + [(False, 2**i) for i in range(7)]
    assert row_buckets(6, 4) == [(True, 1), (True, 2), (True, 4), (False, 1), (False, 2), (False, 4)]
    assert length_buckets(1024) == (256, 1024) and length_buckets(80) == (80,) and length_buckets(2048)[-1] == 2048
    keys = plan_keys(64, 1024, 64, wanted, budget=200)
    assert len(keys) == 7 * 14 * 2  # 7 whole kinds of 28; the 8th would pass 200
    assert {(k.k, k.last_only) for k in keys} == {(k.k, k.last_only) for k in wanted[:7]}
    assert len(plan_keys(64, 1024, 64, wanted, budget=10**6)) == 9 * 28


def test_with_ragged_catch_ups_the_long_last_logits_kind_goes_last():
    """Ragged catch-ups (one graph per token bucket, in the same budget) take the long
    catch-ups the k = 16 last-logits kind pads: that kind goes after verification's, so at the
    defaults the budget left (200 - 9) keeps verification's k = 8 and drops it."""
    wanted = kinds((None,), (True, False), K_BUCKETS, ragged=True)
    assert [(k.k, k.last_only) for k in wanted] == [(1, True), (2, True), (4, True), (8, True)] + [
        (4, False),
        (8, False),
        (2, False),
        (16, False),
        (16, True),
    ]
    keys = plan_keys(64, 1024, 64, wanted, budget=GRAPH_BUDGET - len(RAGGED_TOKENS))
    assert {(k.k, k.last_only) for k in keys} == {(1, True), (2, True), (4, True), (8, True), (4, False), (8, False)}
    assert kinds((None,), (True,), (1, 2), ragged=True) == kinds((None,), (True,), (1, 2))  # M_S: no k = 16


def test_the_papers_pair_fits_one_h200_in_fp8(computed):
    """plan.json's "paper": Llama-3.1-8B- and -70B-shaped models with fp8 decoder weights (a byte a
    parameter, bf16 embeddings and LM heads), bf16 KV for 64 streams x 1024 positions, the graph
    budget: within one H200 with >= 5% of it to spare."""
    paper = computed["paper"]
    small, large = paper["models"]["small"], paper["models"]["large"]
    assert (small["model"], large["model"]) == ("llama-3.1-8b", "llama-3.1-70b")
    embed_and_head = lambda d: 2 * 128256 * d * 2  # noqa: E731 - bf16 bytes
    linears = lambda layers, d, kv, mlp: layers * (d * (2 * d + 2 * kv) + 3 * d * mlp)  # noqa: E731 - fp8 bytes
    assert large["weights_gib"] == pytest.approx(
        (linears(80, 8192, 1024, 28672) + embed_and_head(8192)) / 2**30, rel=1e-3
    )
    assert small["weights_gib"] == pytest.approx(
        (linears(32, 4096, 1024, 14336) + embed_and_head(4096)) / 2**30, rel=1e-3
    )
    # KV in bf16: 320 KiB (70B) and 128 KiB (8B) a position, 64 slots of 1024
    assert (large["kv_gib"], small["kv_gib"], large["slots"], small["slots"]) == (20.0, 8.0, 64, 64)
    assert 0 < small["graphs"] <= GRAPH_BUDGET and 0 < large["graphs"] <= GRAPH_BUDGET
    assert small["fused_gib"] == large["fused_gib"] == 0  # fp8 layers are not fused
    total = sum(m["kv_gib"] + m["weights_gib"] + m["pool_gib"] + m["fused_gib"] for m in (small, large))
    assert paper["total_gib"] == pytest.approx(total, abs=1e-3)
    assert paper["spare"] == pytest.approx(
        (paper["gpu_gib"] - paper["headroom_gib"] - total) / paper["gpu_gib"], abs=1e-3
    )
    assert paper["fits_h200"] and paper["spare"] >= 0.05
