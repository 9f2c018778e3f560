"""benchmarks/results/gpu/plan_tensor_parallel.json (benchmarks/gpu_plan.py) is what the code
computes now, and the paper's pair fits one 8-GPU node of 80 GB H100s: M_L (Llama-3.1-70B's
shape) at TP=4 in bf16 or TP=2 with fp8 weights, M_S (8B) on one GPU. Meta device, no weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu_plan import plan_tensor_parallel

RESULTS = Path(__file__).parents[3] / "benchmarks" / "results" / "gpu"


@pytest.fixture(scope="module")
def computed() -> dict:
    return plan_tensor_parallel()


def test_committed_plan_is_current(computed):
    assert json.loads((RESULTS / "plan_tensor_parallel.json").read_text()) == computed


def test_the_paper_pair_fits_one_node_of_h100s(computed):
    (bf16, fp8, small) = computed["per_rank"]
    assert (bf16["tensor_parallel"], bf16["kv_heads_per_rank"], bf16["weights"]) == (4, 2, "bfloat16")
    # 141.1 GB of bf16 weights over 4, plus the replicated embedding's other three quarters (1.05B x 2 B)
    assert bf16["weights_gib"] == pytest.approx((70.55e9 * 2 / 4 + 128256 * 8192 * 2 * 0.75) / 2**30, rel=0.01)
    assert bf16["kv_gib"] == 5.0  # 320 KiB a position over 4 ranks, 65536 positions
    assert fp8["kv_heads_per_rank"] == 4 and fp8["kv_gib"] == 10.0
    assert all(r["fits_h100_80gb"] for r in computed["per_rank"])
    assert (small["model"], small["tensor_parallel"]) == ("llama-3.1-8b", 1)  # M_S on one GPU: 5 of 8
