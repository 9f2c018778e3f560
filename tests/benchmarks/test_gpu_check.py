"""benchmarks/gpu_check.py's probes, on the CPU (graphs replayed eagerly): they time M_S at
the k the engine does not capture, each model's prefill with and without its graphs, and M_L's
ragged forwards, and benchmarks/gpu_costs.py prices gpu_sim's forwards by them where a run has
them."""

from __future__ import annotations

import json
import shutil

import pytest

from backoff_core.runners.graph_plan import K_BUCKETS, GraphKey
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_ragged import RaggedKey
from benchmarks.gpu_costs import GpuCosts
from benchmarks.gpu_probes import PROBE_KS, commonest, probes, ragged_probe
from benchmarks.step_overhead import tiny_pair
from tests.support.eager_graphs import EagerGraphs
from tests.support.gpu_runs import RUN3


def _graphs(runner: StaticRunner) -> EagerGraphs:
    return EagerGraphs(runner._forward, runner.graph_max_rows, K_BUCKETS[-1], cost=lambda key: key.rows * key.k / 10)


def test_probes_time_m_s_at_every_k_and_each_prefill_with_and_without_graphs():
    (small, large), _ = tiny_pair()
    runners = []
    for model, name in ((small, "small"), (large, "large")):
        runner = StaticRunner(model, name, kv_budget_tokens=8 * 128, max_len=128)
        runner.graphs = _graphs(runner)
        runner.warmup(last_only=(True,), progress=False)
        runners.append(runner)
    prompt = list(range(2, 2 + 43))
    before = [r.eager_passes for r in runners]

    got = probes(small, runners, prompt, graphs=_graphs)

    # M_S at k > 2, dense and gathered, every row bucket up to 64, each at its replay time
    table = got["small_k"]
    assert {e["k"] for e in table} == {k for k in PROBE_KS if k > 2}
    assert {e["rows"] for e in table} == {1, 2, 4, 8, 16, 32, 64} and {e["dense"] for e in table} == {True, False}
    assert all(e["ms"] == pytest.approx(e["rows"] * e["k"] / 10, abs=1e-3) for e in table)
    # the prefill in graphs replays only; with the graphs set aside it runs eagerly (a first
    # run, then 10 timed), and the graphs are back afterwards
    for runner, b, name in zip(runners, before, ("small", "large")):
        prefill = got["prefill_ms"][name]
        assert prefill["tokens"] == 43 and prefill["graphs"] > 0 and prefill["eager"] > 0
        assert runner.eager_passes - b == 11
        assert isinstance(runner.graphs, EagerGraphs)


def test_gpu_costs_read_the_probes_where_a_run_has_them(tmp_path):
    for name in ("gpu_check.json", "catch_up_anatomy.json"):
        shutil.copy(RUN3 / name, tmp_path / name)
    check = json.loads((tmp_path / "gpu_check.json").read_text())
    before = GpuCosts.from_results(tmp_path)
    assert (before.large_eager_ms, before.small_eager_ms) == (65.0, 66.0)  # the estimates

    check["probes"] = {
        "small_k": [
            {"dense": dense, "rows": rows, "k": k, "L": length, "last_only": True, "layer": None, "ms": ms}
            for dense, rows, k, length, ms in [
                (True, 64, 16, 256, 3.1),
                (True, 64, 16, 1024, 9.9),  # a longer L: not the step's
                (False, 64, 16, 256, 9.9),  # gathered: not the dense step's
                (True, 8, 4, 256, 1.9),
            ]
        ],
        "prefill_ms": {
            "small": {"tokens": 43, "graphs": 2.0, "eager": 7.5},
            "large": {"tokens": 43, "graphs": 9.0, "eager": 30.0},
        },
    }
    (tmp_path / "gpu_check.json").write_text(json.dumps(check))
    costs = GpuCosts.from_results(tmp_path)
    assert costs.small_eager_ms == 7.5 and costs.large_eager_ms == pytest.approx(21.0)
    assert costs.small_ms(GraphKey(True, 64, 16, 256, True, None), eager=False) == 3.1
    assert costs.small_ms(GraphKey(True, 5, 4, 256, True, None), eager=False) == 1.9  # rows 5 -> bucket 8
    assert costs.small_ms(GraphKey(True, 64, 1, 256, True, None), eager=False) == before.small_rows[64]
    assert costs.small_ms(GraphKey(True, 64, 8, 256, True, None), eager=False) == pytest.approx(
        before.small_rows[64] * 1.35
    )  # not probed: the estimate
    assert "probes" in costs.source

    check["probes"] = "failed: RuntimeError('out of memory')"
    (tmp_path / "gpu_check.json").write_text(json.dumps(check))
    assert GpuCosts.from_results(tmp_path).small_eager_ms == 66.0


def test_the_sharing_probe_picks_the_full_step_and_the_commonest_catch_up():
    """gpu_check.commonest: the timed graph of a kind with the most rows at the shortest key
    length (last logits, no hidden layer): M_S's dense k=1 step, M_L's gathered k=8 blocks,
    whatever ragged graphs M_L holds beside them; none of the kind: a clear error (the probe
    is then reported as failed)."""

    class Timed:
        def __init__(self, keys):
            self.ms = dict.fromkeys(keys, 1.0)

    keys = [
        GraphKey(True, 64, 1, 256, True, None),
        GraphKey(True, 64, 1, 1024, True, None),
        GraphKey(True, 32, 1, 256, True, None),
        GraphKey(True, 64, 1, 256, True, 3),  # a router's hidden layer
        GraphKey(False, 64, 8, 256, True, None),
        GraphKey(False, 64, 8, 256, False, None),  # full logits
        GraphKey(True, 64, 8, 256, True, None),
        RaggedKey(512),  # M_L's ragged graphs, timed beside the padded ones under `auto` (the default on CUDA)
        RaggedKey(32),
    ]
    assert commonest(Timed(keys), True, 1) == GraphKey(True, 64, 1, 256, True, None)
    assert commonest(Timed(keys), False, 8) == GraphKey(False, 64, 8, 256, True, None)
    with pytest.raises(ValueError, match="no gathered graph of k=4"):
        commonest(Timed(keys), False, 4)


def test_the_ragged_probe_times_every_bucket_and_matches_the_padded_logits():
    """M_L's ragged graphs captured and timed after warmup's (one per token bucket that fits
    the buffers), each beside the dense view of as many token slots; the catch-up's logits
    equal the padded path's; the runner is left padded, its probe sessions closed."""
    (_, large), _ = tiny_pair()
    runner = StaticRunner(large, "large", kv_budget_tokens=8 * 128, max_len=128)
    runner.graphs = EagerGraphs(runner._forward, runner.graph_max_rows, K_BUCKETS[-1])
    runner.warmup(last_only=(True,), progress=False)
    got = ragged_probe(runner, list(range(2, 2 + 43)))
    assert got["graphs"] == 3 and set(got["replay_ms"]) == {32, 64, 128}  # 8 rows x 16: 128 tokens
    assert got["replay_ms"] == {t: 8.0 + t / 64 for t in (32, 64, 128)}  # EagerGraphs' default cost
    assert got["dense_ms"] == {32: 8.5, 64: 9.0, 128: 10.0}  # dense 2x16, 4x16, 8x16
    # timed far too, over the 8 free slots (G = 2: 64 tokens a query block, one block a slot)
    assert got["far"] == {t: {"blocks": 8, "ms": 8.0 + t / 64} for t in (32, 64, 128)}
    assert got["rel_err"] < 1e-5
    assert runner.ragged is False and runner.request_ids() == []


def test_gpu_costs_price_ragged_forwards_as_measured_or_at_their_dense_view(tmp_path):
    for name in ("gpu_check.json", "catch_up_anatomy.json"):
        shutil.copy(RUN3 / name, tmp_path / name)
    before = GpuCosts.from_results(tmp_path)
    shortest = min(n for *_, n in before.large)
    for tokens in (32, 200, 1024):  # no ragged probe yet: the dense view of the bucket's slots
        dense = [ms for (d, r, k, n), ms in before.large.items() if d and n == shortest and r * k >= tokens]
        assert before.large_ms(RaggedKey(tokens), tokens, False) == min(dense)
    check = json.loads((tmp_path / "gpu_check.json").read_text())
    check["ragged"] = {"graphs": 2, "capture_s": 30.0, "replay_ms": {"32": 7.5, "64": 8.25}, "rel_err": 0.004}
    (tmp_path / "gpu_check.json").write_text(json.dumps(check))
    costs = GpuCosts.from_results(tmp_path)
    assert costs.large_ms(RaggedKey(64), 50, False) == 8.25
    assert costs.large_ms(RaggedKey(128), 100, False) == before.large_ms(RaggedKey(128), 100, False)  # not timed


class _Cut(BaseException):
    """The stage's deadline: `timeout` kills the process, which no `except Exception` sees."""


def test_gpu_check_saves_each_section_as_it_ends_so_a_cut_keeps_them(tmp_path, monkeypatch):
    """gpu_check.main over stand-ins of its GPU parts: the replay times are saved before the
    first routing runs, and a stage cut inside the `probes` section keeps every section before it."""
    import types

    import benchmarks.gpu_check as gc

    written: list[set[str]] = []
    (small, large), tokenizer = tiny_pair()
    chain = types.SimpleNamespace(models=[small, large], tokenizer=tokenizer, context_window=512)
    monkeypatch.setattr(gc, "load_chain", lambda *a, **k: chain)
    monkeypatch.setattr(gc, "logits_error", lambda *a: 0.01)
    monkeypatch.setattr(gc, "plan_default", lambda *a: {"models": {}})
    monkeypatch.setattr(gc, "replay_table", lambda runner: [{"ms": 1.0}])
    monkeypatch.setattr(gc, "encode_prompt", lambda *a, **k: [3, 4, 5])

    class Engine:
        def __init__(self, *a, **k) -> None:
            pass

        def generate_many(self, reqs):
            save = tmp_path / "gpu_check.json"
            written.append(set(json.loads(save.read_text())) if save.exists() else set())
            return [types.SimpleNamespace(token_ids=(1, 2), sources=[0, 1]) for _ in reqs]

    monkeypatch.setattr(gc, "BackoffEngine", Engine)
    monkeypatch.setattr(gc, "anatomy", lambda *a: {"steps": 1})
    monkeypatch.setattr(gc, "sharing", lambda runners: (_ for _ in ()).throw(RuntimeError("no second stream")))

    def cut(*a):
        raise _Cut

    monkeypatch.setattr(gc, "probes", cut)
    monkeypatch.setattr(gc, "ragged_probe", lambda *a: pytest.fail("the stage was cut before it"))
    runner = types.SimpleNamespace(eager_passes=0, forward_passes=0, ragged=True)
    monkeypatch.setattr(gc, "build", lambda chain, kv: ([runner, runner], {"graphs": [1, 2]}))
    cuda = types.SimpleNamespace(
        synchronize=lambda: None, get_device_name=lambda: "stand-in", memory_reserved=lambda: 0
    )
    monkeypatch.setattr(gc.torch, "cuda", cuda)
    monkeypatch.setattr("sys.argv", ["gpu_check.py", "--small", "s", "--large", "l", "--out", str(tmp_path)])

    with pytest.raises(_Cut):
        gc.main()
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "replay_ms" in written[0]  # saved before the first routing ran
    assert "ragged_at_load" in written[0] and report["ragged_at_load"] is True  # M_L kept its ragged graphs (auto)
    assert report["generate_many_4x"] and report["step_anatomy"] == {"steps": 1}
    assert report["sharing"].startswith("failed: RuntimeError") and "probes" not in report and "ragged" not in report
