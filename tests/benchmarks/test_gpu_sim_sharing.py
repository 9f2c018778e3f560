"""benchmarks/gpu_sim_sharing.py: the in-flight row's 64-vs-one ratio over how much M_S's steps
and a flight slow each other on one GPU. No slowdown is M_L on a timeline of its own; a
flight slowed more scales less; the probe's own points are simulated where a run has them."""

from __future__ import annotations

import dataclasses
import json
import sys

from benchmarks import gpu_sim_sharing
from benchmarks.gpu_costs import GpuCosts
from tests.support.gpu_runs import RUN3

SMALL = ("--slowdowns", "1", "2", "--repeats", "1", "--tokens", "16", "--costs", str(RUN3))


def test_no_slowdown_is_two_timelines_and_a_slower_flight_scales_less(tmp_path, monkeypatch):
    argv = ["gpu_sim_sharing.py", *SMALL, "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    gpu_sim_sharing.main()
    report = json.loads((tmp_path / "gpu_sim_sharing.json").read_text())
    assert (tmp_path / "gpu_sim_sharing.png").stat().st_size > 0
    grid, two = report["grid"], report["reference"]["in flight, two timelines"]
    assert set(grid) == {"1,1", "1,2", "2,1", "2,2"}
    assert grid["1,1"] == two  # a and b of 1: neither slows the other
    assert grid["1,2"]["ratio"] < grid["1,1"]["ratio"] and grid["2,2"]["ratio"] < grid["2,1"]["ratio"]
    assert grid["2,2"]["ratio"] <= grid["1,2"]["ratio"]
    assert report["measured"] == {}  # the third run had no sharing probe


def test_the_probes_points_are_simulated_where_measured(tmp_path, monkeypatch):
    """A run whose gpu_check.json has the sharing probe: the row at each (a, b) it measured,
    one priority and either side first, the same as the grid's cell at that point."""
    probed = {"sharing": (2.0, 2.0), "sharing_first": {"loop": (1.0, 2.0), "flight": (2.0, 1.0)}}
    costs = dataclasses.replace(GpuCosts.from_results(RUN3), **probed)
    monkeypatch.setattr(gpu_sim_sharing.GpuCosts, "from_results", lambda folder: costs)
    argv = ["gpu_sim_sharing.py", *SMALL, "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    gpu_sim_sharing.main()
    report = json.loads((tmp_path / "gpu_sim_sharing.json").read_text())
    grid, measured = report["grid"], report["measured"]
    assert set(measured) == {"one priority", "loop first", "flight first"}
    for label, cell in (("one priority", "2,2"), ("loop first", "1,2"), ("flight first", "2,1")):
        assert measured[label]["sharing"] == [float(x) for x in cell.split(",")]
        assert {k: measured[label][k] for k in ("tok_per_s", "ratio")} == grid[cell]
