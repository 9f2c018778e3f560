"""gpu_sim.py's report: the simulated figures set beside a GPU run's, and printed."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path


def validate(rows: dict, measured_path: Path | None) -> dict:
    """The simulated tok/s over what the GPU run measured, per routing and n."""
    if measured_path is None or not measured_path.exists():
        return {}
    measured = json.loads(measured_path.read_text())["tok_per_s"]
    return {
        label: {n: round(cell["tok_per_s"] / measured[label][n], 3) for n, cell in row.items() if n in measured[label]}
        for label, row in rows.items()
        if label in measured
    }


def print_report(report: dict, streams: list[int]) -> None:
    print(f"\n{'routing (simulated tok/s)':34s} " + " ".join(f"{'n=' + str(n):>9s}" for n in streams) + "  x n=1")
    for label, row in report["tok_per_s"].items():
        cells = " ".join(f"{row[str(n)]:9.0f}" for n in streams)
        print(f"{label:34s} {cells}  x{report['scaling_vs_n1'][label]:.1f}")
    if report["sim_over_gpu_run"]:
        print("\nsimulated (this checkout) / measured by the GPU run (its own checkout)")
        for label, row in report["sim_over_gpu_run"].items():
            print(f"{label:34s} " + " ".join(f"{row.get(str(n), float('nan')):9.2f}" for n in streams))
    for label, cell in report["at_top_n"].items():
        shapes = Counter({k: v["count"] for k, v in cell["large_by_shape"].items()})
        print(
            f"{label}: {cell['steps']} steps, M_L {cell['large_forwards']} forwards {cell['large_ms']:.0f} ms "
            f"(real {cell['large_real_share']:.0%}), M_S {cell['small_forwards']} forwards {cell['small_ms']:.0f} ms, "
            f"host {cell['host_ms']:.0f} ms, the drain {cell['drain_share']:.0%} of it; {dict(shapes.most_common(6))}"
        )
    if "sustained_tok_per_s" in report:
        print("\nn streams kept busy (simulated tok/s)")
        for label, row in report["sustained_tok_per_s"].items():
            cells = " ".join(f"{row[str(n)]:9.0f}" for n in streams)
            print(f"{label:34s} {cells}  x{row[str(streams[-1])] / row[str(streams[0])]:.1f}")
        print(f"where the time went at n={streams[-1]} (ms): {report['sustained_ms_at_top_n']}")
    if "forwards_vs_gpu_run" in report:
        print("\nM_L forwards at 64 streams, b=0.9: simulated (this checkout) vs the GPU run (catch_up_anatomy.json)")
        for label, c in report["forwards_vs_gpu_run"].items():
            print(f"  {label}: {c['simulated']} vs {c['gpu_run']}")
