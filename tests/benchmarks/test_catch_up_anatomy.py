"""benchmarks/catch_up_anatomy.py's record of M_L's forwards: padded and ragged alike (KVSpec
ragged "auto", the default on CUDA, runs catch-ups ragged where timed faster), over the
runner's graph bookkeeping replayed eagerly on the CPU."""

from __future__ import annotations

from backoff_core.runners.graph_plan import K_BUCKETS
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_ragged import RaggedKey
from benchmarks.catch_up_anatomy import record_forwards, summarise, unwrap
from tests.support.eager_graphs import EagerGraphs
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
    run.extend([("a", [6] * 20), ("b", [7] * 9)], last_only=True)  # ragged: 29 tokens of a 32-token forward
    assert [(f["rows"], f["k"], f["L"], f["items"], f["real"]) for f in log] == [(2, 4, 128, 2, 5), (1, 32, 0, 2, 29)]
    summary = summarise(log)
    assert set(summary["by_shape"]) == {"ragged 32", "dense 2x4 L128"} and summary["forwards"] == 2
    assert summary["real_tokens"] == 34 and summary["token_slots"] == 8 + 32
    unwrap(run)
    run.extend([("a", [1, 2])], last_only=True)
    assert len(log) == 2  # no longer recorded
