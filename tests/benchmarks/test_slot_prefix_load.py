"""benchmarks/slot_prefix_load.py at a small size: its per-layer references do what StaticKV's
one-op write and read do (so the ratio compares like with like), and every figure is saved."""

from __future__ import annotations

import json
import sys

import torch

from backoff_core.runners.static_kv import StaticKV
from benchmarks import slot_prefix_load
from tests.support.tiny import tiny_model


def test_the_per_layer_references_load_and_copy_out_what_the_one_op_paths_do():
    model = tiny_model(2, hidden=64, layers=3)
    one, per_layer = StaticKV(model, 4 * 64, 64), StaticKV(model, 4 * 64, 64)
    block = torch.randn(3, 2, one.kv_heads, 9, one.head_dim)
    one.write(2, block)
    slot_prefix_load.write_per_layer(per_layer, 2, block)
    assert torch.equal(one.storage, per_layer.storage)
    assert torch.equal(slot_prefix_load.read_per_layer(per_layer, 2, 3, 9), one.read(2, 3, 9))


def test_the_script_saves_both_ways_at_every_layer_count(tmp_path, monkeypatch):
    out = tmp_path / "slot.json"
    argv = ["slot_prefix_load.py", "--layers", "2,3", "--requests", "4", "--repeats", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    slot_prefix_load.main()
    report = json.loads(out.read_text())
    assert list(report["layers"]) == ["2", "3"] and report["requests"] == 4
    for row in report["layers"].values():
        assert set(row["ms_a_request"]) == {"write one op", "write per layer", "read one op", "read per layer"}
        assert all(v > 0 for v in row["ms_a_request"].values())
        assert set(row["per_layer_over_one_op"]) == {"write", "read"}
