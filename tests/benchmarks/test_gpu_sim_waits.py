"""benchmarks/gpu_sim_waits.py: the hold's time bound swept in the simulator. A bound of 0 is
catch-ups at once (a forward in every step that routes), a long one lets the hold batch them."""

from __future__ import annotations

import json
import sys

from benchmarks import gpu_sim_waits
from tests.support.gpu_runs import RUN3


def test_the_sweep_saves_each_layout_and_bound_and_a_zero_bound_batches_nothing(tmp_path, monkeypatch):
    out = tmp_path / "waits.json"
    argv = ["gpu_sim_waits.py", "--streams", "8", "--tokens", "16", "--waits", "0,1000", "--costs", str(RUN3)]
    argv += ["--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    gpu_sim_waits.main()
    saved = json.loads(out.read_text())
    assert (saved["streams"], saved["tokens"]) == (8, 16)
    for layout in ("blocks", "ragged"):
        rows = saved["waits_ms"][layout]
        assert set(rows) == {"0", "1000"}
        at_once, held = rows["0"], rows["1000"]
        assert at_once["large_forwards"] > held["large_forwards"]  # the hold shares forwards
        assert all(row["together_tok_per_s"] > 0 and row["kept_busy_tok_per_s"] > 0 for row in rows.values())
        assert held["together_vs_one"] > 1  # 8 streams outrun one
