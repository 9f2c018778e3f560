"""The GPU run the tests read: the third H100 run's files (2026-11-25; the engine as of 33023db),
frozen here. Tests of the simulator and of the cost tables read these, not
benchmarks/results/gpu/, so that committing a new run's figures there changes no test: the
next run's gpu_check.json brings probes (`sharing`, `ragged`, `probes`) this one lacks, and
its costs would move figures the tests pin. test_gpu_plan.py alone reads the latest run, whose
plan it checks against what that run measured."""

from __future__ import annotations

from pathlib import Path

RUN3 = (
    Path(__file__).resolve().parents[1] / "fixtures" / "gpu_h100_run3"
)  # gpu_check, catch_up_anatomy, batch_scaling-h100
