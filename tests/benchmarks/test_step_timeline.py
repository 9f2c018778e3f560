"""benchmarks/step_timeline.py, the split of a batch's wall time into the forwards', the draws'
and the rest, and benchmarks/gpu_costs.fit_host, which reads a step's host work back out of
it for the simulator. On the CPU the forwards run synchronously, so each mark is the clock."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from backoff_core.engine import catchup, host, propose
from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.factory import make_runner
from backoff_core.runners.graph_plan import K_BUCKETS
from backoff_core.sampling import draw
from backoff_core.types import KVSpec, RoutingParams
from benchmarks import step_timeline
from benchmarks.gpu_costs import GpuCosts, fit_host
from benchmarks.step_overhead import tiny_pair
from benchmarks.step_timeline import Timeline, measure, run
from tests.support.eager_graphs import EagerGraphs
from tests.support.gpu_runs import RUN3

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    (small, large), tokenizer = tiny_pair()
    kv = KVSpec(64 * 64, 64)
    runners = [make_runner(small, "small", kv, small=True), make_runner(large, "large", kv)]
    return BackoffEngine(runners, tokenizer)


@pytest.mark.parametrize(
    ("router", "small_forwards", "large_forwards"), [("always-small", 8, 0), ("always-large", 0, 8)]
)
def test_each_step_is_one_forward_one_draw_and_one_read(engine, router, small_forwards, large_forwards):
    """4 requests of 8 tokens: 8 steps, each one forward of the model that routing runs, one
    draw and one read; the prompts' forwards (admission) are outside the timeline, as they are
    outside the clock; the wrappers are gone after it."""
    with Timeline(engine) as timeline:
        seconds, tokens, steps, _ = run(engine, PROMPT, 4, 8, RoutingParams(router=router), timeline)
        forwards = timeline.device_ms()
        reads = timeline.reads
    assert (tokens, steps, reads) == (32, 8, 8)
    counts = {label: f["count"] for label, f in forwards.items()}
    assert counts == {"draws": 8} | ({"small padded": 8} if small_forwards else {}) | (
        {"large padded": 8} if large_forwards else {}
    )
    assert 0 < sum(f["ms"] for f in forwards.values()) < 1e3 * seconds
    assert all("_run" not in vars(runner) for runner in engine.models)
    assert propose.draw is draw and catchup.draw is draw
    assert host.Read.values.__qualname__ == "Read.values"  # the class's own again


def test_ragged_catch_ups_are_timed_as_such():
    """A large runner with graphs (replayed eagerly here) and ragged catch-ups "on": always-large,
    4 requests of 6 tokens, one M_L forward a step; the first carries the prompts (ragged), the
    others one token a request (padded: one token a row pads nothing). The timeline tells
    them apart, and unwraps the graphs' method after."""
    torch.manual_seed(0)
    (small, large), tokenizer = tiny_pair()
    kv = KVSpec(64 * 64, 64)
    big = make_runner(large, "large", kv)
    big.graphs = EagerGraphs(big._forward, big.graph_max_rows, K_BUCKETS[-1])
    big.ragged, big.ragged_if_faster = True, False  # KVSpec ragged "on": wherever they apply
    big.capture_ragged(progress=False)
    engine = BackoffEngine([make_runner(small, "small", kv, small=True), big], tokenizer)
    with Timeline(engine) as timeline:
        run(engine, PROMPT, 4, 6, RoutingParams(router="always-large"), timeline)
        forwards = timeline.device_ms()
    assert {label: f["count"] for label, f in forwards.items()} == {"large ragged": 1, "large padded": 5, "draws": 6}
    assert "replay_ragged" not in vars(big.graphs)


def test_a_row_is_measured_plain_timed_and_profiled(engine):
    cell = measure(engine, PROMPT, 4, 8, RoutingParams(router="random", rate=0.5), repeats=2)
    timed = cell["events_run"]
    assert cell["tok_per_s"] == pytest.approx(32 / cell["seconds"], rel=1e-3)
    assert timed["device_idle_ms"] == pytest.approx(1e3 * timed["seconds"] - timed["forwards_device_ms"], abs=0.2)
    assert timed["reads"] >= cell["steps"] and timed["forwards"]["small padded"]["count"] == cell["steps"]
    assert any("(step)" in line for line in cell["profile_cumtime"])  # the profiled run is the step loop
    assert not any("(submit)" in line or "(prefill)" in line for line in cell["profile_cumtime"])  # alone
    assert cell["admission_ms"] > 0


def test_the_script_saves_every_row_on_a_tiny_pair(tmp_path, monkeypatch):
    pair = tmp_path / "pair"
    (small, large), tokenizer = tiny_pair()
    for name, model in (("small", small), ("large", large)):
        model.save_pretrained(pair / name)
        tokenizer.save_pretrained(pair / name)
    args = ["--small", str(pair / "small"), "--large", str(pair / "large"), "--device", "cpu", "--dtype", "float32"]
    args += ["--kv-budget", "4096", "--max-len", "128", "--tokens", "6", "--streams", "1,4", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", ["step_timeline.py", *args, "--out", str(tmp_path / "out")])
    step_timeline.main()
    report = json.loads((tmp_path / "out" / "step_timeline.json").read_text())
    assert report["gpu"] is None and list(report["rows"]) == list(step_timeline.ROWS)
    for label, row in report["rows"].items():
        assert set(row) == {"1", "4", "x_first"} and row["x_first"]["1"] == 1.0, label


def _timeline(per_step: float, per_row: float, per_catch_up: float, draws_ms: float) -> dict:
    """A made-up run whose time beyond its forwards is per_step * steps + per_row * rows +
    per_catch_up * M_L forwards exactly (the draws count as host: the simulator prices them so)."""

    def cell(n: int, small_ms: float, large_ms: float, catch_ups: int) -> dict:
        steps = 64
        rest = per_step * steps + per_row * 64 * n + per_catch_up * catch_ups
        forwards = {"draws": {"count": steps, "ms": draws_ms}}
        if small_ms:
            forwards["small padded"] = {"count": steps, "ms": small_ms}
        if large_ms:
            forwards["large ragged"] = {"count": catch_ups, "ms": large_ms}
        seconds = (small_ms + large_ms + draws_ms + rest) / 1e3
        return {"seconds": seconds, "steps": steps, "events_run": {"forwards": forwards, "seconds": seconds}}

    return {
        "tokens": 64,
        "rows": {
            "always-small": {"1": cell(1, 120.0, 0.0, 0), "64": cell(64, 160.0, 0.0, 0)},
            "always-large": {"1": cell(1, 0.0, 500.0, 64), "64": cell(64, 0.0, 600.0, 64)},
        },
    }


def test_fit_host_reads_back_the_constants_of_a_made_up_run():
    got = fit_host(_timeline(0.2, 0.01, 1.5, draws_ms=0.0))
    assert got == pytest.approx({"host_ms": 0.2, "host_ms_per_row": 0.01, "host_ms_per_catch_up": 1.5})
    with_draws = fit_host(_timeline(0.2, 0.01, 1.5, draws_ms=30.0))  # 30 ms more a run: host to the simulator
    assert with_draws["host_ms"] + 64 * with_draws["host_ms_per_row"] == pytest.approx(0.2 + 0.64 + 30 / 64)


def test_gpu_costs_fit_the_host_where_the_run_has_a_timeline(tmp_path):
    for name in ("gpu_check.json", "catch_up_anatomy.json"):
        shutil.copy(RUN3 / name, tmp_path / name)
    before = GpuCosts.from_results(tmp_path)
    assert (before.host_ms, before.host_ms_per_row, before.host_ms_per_catch_up) == (0.25, 0.007, 0.35)
    (tmp_path / "step_timeline.json").write_text(json.dumps(_timeline(0.2, 0.01, 1.5, draws_ms=0.0)))
    fitted = GpuCosts.from_results(tmp_path)
    assert (fitted.host_ms, fitted.host_ms_per_row, fitted.host_ms_per_catch_up) == pytest.approx((0.2, 0.01, 1.5))
    assert "step_timeline.json (the host)" in fitted.source
    given = GpuCosts.from_results(tmp_path, host_ms=0.5)  # what the caller gives stands
    assert (given.host_ms, given.host_ms_per_row) == pytest.approx((0.5, 0.01))
