"""benchmarks/gc_pauses.py end to end at a small size: each row runs with the heap as loaded
and frozen, the collections of each run are its own, the heap is left unfrozen, and its
figures and plot are saved."""

from __future__ import annotations

import gc
import json
import sys

import pytest

pytest.importorskip("ray")  # the serving stack's heap is what it measures (the GPU image has no Ray)
from benchmarks import gc_pauses  # noqa: E402


def test_each_row_runs_as_loaded_then_frozen_and_the_figures_are_saved(tmp_path, monkeypatch):
    argv = ["gc_pauses.py", "--streams", "3", "--prompt", "6", "--tokens", "24", "--pairs", "1", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    gc_pauses.main()
    assert gc.get_freeze_count() == 0  # the test process's heap as it was
    report = json.loads((tmp_path / "gc_pauses.json").read_text())
    assert list(report["runs"]) == list(gc_pauses.ROWS)
    for runs in report["runs"].values():
        as_is, frozen = runs
        assert (as_is["frozen"], frozen["frozen"]) == (False, True)
        assert as_is["objects_frozen"] == 0 < frozen["objects_frozen"]
        # frozen, the collector's lists lose the loaded heap (torch, Ray Serve, the pair)
        assert frozen["objects_tracked"] < as_is["objects_tracked"] / 2
        for run in runs:
            assert run["steps"] > 0 and len(run["collections"]) == len(run["pause_ms"]) == 3
            assert run["longest_pause_ms"] <= sum(run["pause_ms"]) + 1e-9
    for ratios in report["ratios"].values():
        assert len(ratios["steps_sum_as_is_over_frozen"]) == 1
    assert (tmp_path / "gc_pauses.png").stat().st_size > 0
