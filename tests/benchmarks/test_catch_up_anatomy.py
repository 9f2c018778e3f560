"""benchmarks/catch_up_anatomy.py's record of M_L's forwards: padded and ragged alike (KVSpec
ragged "auto", the default on CUDA, runs catch-ups ragged where timed faster), over the
runner's graph bookkeeping replayed eagerly on the CPU; its report saved as it goes."""

from __future__ import annotations

import json
import sys

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.graph_plan import K_BUCKETS
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_ragged import RaggedKey
from benchmarks import catch_up_anatomy
from benchmarks.catch_up_anatomy import record_forwards, summarise, unwrap
from tests.support.eager_graphs import EagerGraphs
from tests.support.served_app import TINY_PAIR, save_tiny_models
from tests.support.tiny import tiny_model


def test_padded_and_ragged_forwards_are_recorded_and_unwrapped():
    model = tiny_model(2, hidden=64, layers=2)
    run = StaticRunner(model, "large", kv_budget_tokens=4 * 128, max_len=128, ragged=True, ragged_if_faster=True)
    run.graphs = EagerGraphs(run._forward, run.graph_max_rows, K_BUCKETS[-1])
    run.warmup(progress=False)
    for request_id in ("a", "b"):
        run.open(request_id)
    log = record_forwards(run)
    run.extend([("a", [1, 2, 3]), ("b", [4, 5])], last_only=True)  # padded: the 2 x 4 dense view (8.1) beats 8.5
    # now every ragged forward is timed cheaper than any padded layout
    run.graphs.ms = {key: 0.1 if isinstance(key, RaggedKey) else 1.0 for key in run.graphs.ms}
    run.graphs.far = {}  # and not timed far: priced at that however far they read
    run.extend([("a", [6] * 20), ("b", [7] * 9)], last_only=True)  # ragged: 29 tokens of a 32-token forward
    assert [(f["rows"], f["k"], f["L"], f["items"], f["real"]) for f in log] == [(2, 4, 128, 2, 5), (1, 32, 0, 2, 29)]
    summary = summarise(log)
    assert set(summary["by_shape"]) == {"ragged 32", "dense 2x4 L128"} and summary["forwards"] == 2
    assert summary["real_tokens"] == 34 and summary["token_slots"] == 8 + 32
    unwrap(run)
    run.extend([("a", [1, 2])], last_only=True)
    assert len(log) == 2  # no longer recorded


def test_the_report_is_saved_after_each_label(tmp_path, monkeypatch):
    """catch_up_anatomy.main over a saved tiny pair: the grid and each label's record, saved as
    each label ends, so that a stage cut at its deadline during the second keeps the first."""
    dirs = save_tiny_models(tmp_path / "pair", TINY_PAIR)
    out = tmp_path / "out"
    argv = ["catch_up_anatomy.py", "--small", dirs["small"], "--large", dirs["large"], "--kv-budget", "1024"]
    monkeypatch.setattr(sys, "argv", [*argv, "--max-len", "128", "--streams", "3", "--tokens", "6", "--out", str(out)])
    saved = []
    generate_many = BackoffEngine.generate_many

    def noting(engine, requests):  # what the file holds as each label's run starts
        path = out / "catch_up_anatomy.json"
        saved.append(sorted(json.loads(path.read_text())) if path.exists() else None)
        return generate_many(engine, requests)

    monkeypatch.setattr(BackoffEngine, "generate_many", noting)
    catch_up_anatomy.main()
    report = json.loads((out / "catch_up_anatomy.json").read_text())
    assert saved[0] is None and "batched" in saved[1] and "at once" not in saved[1]
    assert report["batched"]["tokens"] == report["at once"]["tokens"] == 3 * 6
    assert report["batched"]["large"]["forwards"] > 0
