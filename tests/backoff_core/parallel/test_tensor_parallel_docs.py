"""docs/tensor-parallel.md's tables are the numbers of their results files, to the precision
printed: benchmarks/results/tensor_parallel.json (benchmarks/tensor_parallel.py) and
benchmarks/results/gpu/plan_tensor_parallel.json (benchmarks/gpu_plan.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).parents[3]
PAGE = (ROOT / "docs" / "tensor-parallel.md").read_text()


def _row(label: str) -> list[str]:
    line = next(line for line in PAGE.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def test_the_catch_up_table_is_the_results_file():
    results = json.loads((ROOT / "benchmarks" / "results" / "tensor_parallel.json").read_text())["results"]
    labels = {(1, "-", 1): "TP=1, 1 thread", (1, "-", 2): "TP=1, 2 threads"}
    labels |= {
        (3, "vocab", 1): "TP=3, head split by vocabulary (default)",
        (3, "rank0", 1): "TP=3, whole head on rank 0",
    }
    for key, label in labels.items():
        cells = _row(label)
        for k, (ms, share) in zip((1, 4), (cells[0:2], cells[2:4])):
            (r,) = [r for r in results if (r["tensor_parallel"], r["head"], r["threads_per_rank"], r["k"]) == (*key, k)]
            assert ms == f"{r['median_ms']:.1f}"
            assert share == ("—" if key[0] == 1 else f"{100 * r['collective_share']:.0f} %")
    assert all(r["max_abs_diff_vs_tp1"] < 1e-4 for r in results)


def test_the_plan_table_is_the_plan_file():
    plan = json.loads((ROOT / "benchmarks" / "results" / "gpu" / "plan_tensor_parallel.json").read_text())
    for r in plan["per_rank"]:
        label = f"{r['model']}, TP={r['tensor_parallel']}, {r['weights']} ({r['kv_heads_per_rank']} KV heads a rank)"
        want = [f"{r[k]:.1f}" for k in ("weights_gib", "kv_gib", "pool_gib", "total_gib", "free_gib")]
        assert _row(label) == want
    assert re.search(r"M_L rank 39\.8 GiB", (ROOT / "docs" / "cluster.md").read_text().replace("\n", " "))
