"""benchmarks/fused_step.py: its goals' arithmetic on a hand-written report, the bytes a
one-token forward reads, the cards' spec bandwidth, and a dry run on the CPU (the eager mode
over a tiny pair saved to disk) that saves every row with its realised routed share."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import fused_step
from benchmarks.fused_step import goals, read_bytes, spec_bandwidth
from tests.support.tiny import tiny_model, tiny_tokenizer


def _row(tok: float, routed: float = 0.0) -> dict:
    return {"tok_per_s": tok, "routed_share": routed}


def test_the_goals_are_the_measured_ratios():
    report = {
        "spec_bandwidth": 4.8e12,
        "large_read_bytes": 14.4e9,  # 3 ms a token at the floor
        "modes": {
            "on": {
                "replays": {
                    "small rows=1 keys=256": {"replay_ms": 1.0},
                    "small rows=1 keys=1024": {"replay_ms": 1.2},
                    "large rows=1 keys=256": {"replay_ms": 4.0},
                },
                "rows": {
                    "always-large": {"1": _row(200.0, 1.0), "16": _row(2000.0, 1.0), "64": _row(8000.0, 1.0)},
                    "random b=0.9": {"1": _row(500.0, 0.1), "16": _row(3000.0, 0.1), "64": _row(9000.0, 0.1)},
                    "random b=0.9, launched ahead": {"1": _row(600.0, 0.1), "16": _row(2900.0, 0.1)},
                },
            }
        },
    }
    got = goals(report)["on"]
    assert got["M_L_alone_over_peak"] == pytest.approx(0.6)  # 200 tok/s x 3 ms
    assert got["M_L_replay_over_peak"] == pytest.approx(0.75)
    assert got["b09_over_M_L_alone_n1"] == pytest.approx(3.0)  # the better of the two b=0.9 rows
    assert got["b09_over_always_large_n16"] == pytest.approx(1.5)
    assert got["b09_over_always_large_n64"] == pytest.approx(1.125)  # the only row measured there
    assert got["b09_over_bandwidth_ideal_n1"] == pytest.approx(600 / (1e3 / (1.0 + 0.1 * 3.0)), abs=1e-3)
    assert got["c_S_ms_1row_1024keys"] == 1.2 and got["c_S_ms_64rows_1024keys"] is None


def test_read_bytes_leave_out_an_untied_embedding_table():
    model = tiny_model(1, hidden=32, layers=1)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.get_input_embeddings().weight
    assert read_bytes(model) == total - table.numel() * table.element_size()
    model.lm_head.weight = table  # tied: the table is the LM head, read whole
    assert read_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters())


def test_spec_bandwidth_by_the_cards_name():
    assert spec_bandwidth("NVIDIA H200") == 4.8e12 and spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert spec_bandwidth("NVIDIA L40S") is None and spec_bandwidth(None) is None


def test_a_dry_run_saves_every_row_with_its_routed_share(tmp_path, monkeypatch):
    for name, (seed, hidden, layers) in {"small": (1, 32, 2), "large": (2, 64, 2)}.items():
        tiny_model(seed, hidden=hidden, layers=layers).save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    argv = ["fused_step.py", "--small", str(tmp_path / "small"), "--large", str(tmp_path / "large")]
    argv += ["--device", "cpu", "--dtype", "float32", "--kv-budget", "8192", "--max-len", "128", "--tokens", "4"]
    argv += ["--repeats", "1", "--repeats-one", "1", "--modes", "off", "--tag", "dry", "--out", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    fused_step.main()
    report = json.loads((tmp_path / "out" / "fused_step-dry.json").read_text())
    rows = report["modes"]["off"]["rows"]
    assert set(rows) == set(fused_step.ROWS) and all(set(r) == {"1", "16", "64"} for r in rows.values())
    assert rows["always-large"]["16"]["routed_share"] == 1.0 and rows["always-small"]["64"]["routed_share"] == 0.0
    assert 0 < rows["random b=0.9"]["64"]["routed_share"] < 0.3
    assert report["modes"]["off"]["logits_rel_err"]["large"] < 1e-4  # float32: HF's logits
    assert report["goals"]["off"]["b09_over_always_large_n64"] is not None and report["skipped"] == []


def test_past_the_deadline_the_first_mode_still_loads_replays_and_checks_its_logits(tmp_path, monkeypatch):
    """`gpu_bench.sh all` runs fused with FUSED_DEADLINE 60, under the compiled load's time: the
    first mode's load and logits (and, on a GPU, replays and kernel tables) run, every row and
    any later mode are skipped and named."""
    for name, (seed, hidden, layers) in {"small": (1, 32, 2), "large": (2, 64, 2)}.items():
        tiny_model(seed, hidden=hidden, layers=layers).save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    argv = ["fused_step.py", "--small", str(tmp_path / "small"), "--large", str(tmp_path / "large")]
    argv += ["--device", "cpu", "--dtype", "float32", "--kv-budget", "8192", "--max-len", "128", "--deadline", "0"]
    argv += ["--modes", "off,on", "--tag", "cut", "--out", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    fused_step.main()
    report = json.loads((tmp_path / "out" / "fused_step-cut.json").read_text())
    assert list(report["modes"]) == ["off"] and report["modes"]["off"]["rows"] == {}
    assert report["modes"]["off"]["logits_rel_err"]["large"] < 1e-4
    rows = [f"off: {label} at n={n}" for n in (1, 16, 64) for label in fused_step.ROWS]
    assert report["skipped"] == [*rows, "on: load"]
