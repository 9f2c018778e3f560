"""benchmarks/batch_scaling.py's figures on the tiny pair: its forwards count (CatchUp
records, a shared forward split between its requests) and the batched catch-ups it compares."""

from __future__ import annotations

import pytest
import torch

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.graph_plan import K_BUCKETS
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_ragged import RAGGED_TOLERANCE
from backoff_core.types import RoutingParams
from benchmarks.batch_scaling import ROUTINGS, _large_graphs, _ragged, measure, ragged_mode, throughput
from benchmarks.step_overhead import tiny_pair
from tests.support.eager_graphs import EagerGraphs


class Counted(ModelRunner):
    def __init__(self, model, name):
        super().__init__(model, name)
        self.forwards = 0

    def extend(self, items, hidden_layer=None, last_only=False):
        self.forwards += 1
        return super().extend(items, hidden_layer, last_only)


def test_forwards_per_100_tokens_counts_the_large_models_forwards():
    torch.manual_seed(0)
    (small, large), tokenizer = tiny_pair()
    figures = {}
    for wait in (0, 1e4):
        runner = Counted(large, "large")
        engine = BackoffEngine([ModelRunner(small, "small"), runner], tokenizer)
        got = throughput(engine, [5, 6, 7], 16, 24, RoutingParams(router="random", rate=0.9), 2, wait)
        assert got["tok_per_s"] > 0 and engine.catch_up_wait_ms == wait
        per_100 = got["forwards_per_100_tokens"]
        assert per_100 == pytest.approx(100 * runner.forwards / (2 * 16 * 24))  # a forward split between its rows
        assert 0 < got["itl_median_ms"] <= got["itl_p99_ms"]
        assert 0.02 < got["routed_share"] < 0.25  # the realised share of tokens M_L gave, at rate 0.9
        figures[wait] = per_100
    assert figures[1e4] < 0.6 * figures[0]  # 16 streams at 10% large: most steps route one or more


def test_the_in_flight_rows_run_catch_ups_beside_the_steps():
    """ "random b=0.9, in flight" (and "loop first", "flight first"): the engine's catch-ups
    in flight on its worker thread, the launcher's `first` as the row says; the forwards of
    every request are counted as in the synchronous rows."""
    torch.manual_seed(0)
    (small, large), tokenizer = tiny_pair()
    runner = Counted(large, "large")
    engine = BackoffEngine([ModelRunner(small, "small"), runner], tokenizer)
    for label, first in (("in flight", None), ("in flight, loop first", "loop"), ("in flight, flight first", "flight")):
        routing, wait, flight = ROUTINGS[f"random b=0.9, {label}"]
        before = runner.forwards
        got = throughput(engine, [5, 6, 7], 16, 24, routing, 2, wait, flight)
        assert engine.overlap_catch_ups and engine.launcher.first == first and not engine.has_work()
        assert got["tok_per_s"] > 0 and runner.forwards > before
        assert got["forwards_per_100_tokens"] == pytest.approx(100 * (runner.forwards - before) / (2 * 16 * 24))


class _Failed:
    """A catch-up that failed on its worker (as a CUDA error raised on the side stream would)."""

    def done(self) -> bool:
        return True

    def result(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class _FailingLauncher:
    def __init__(self) -> None:
        self.launched = 0

    def submit(self, catch):
        self.launched += 1
        return _Failed()


def test_a_row_that_raises_is_reported_and_the_others_are_measured():
    """The batch stage's first run of the rows in flight on a GPU: if they raise, the rows
    before them are kept, the error is in the results, and the engine is left clean."""
    torch.manual_seed(0)
    (small, large), tokenizer = tiny_pair()
    launcher = _FailingLauncher()
    engine = BackoffEngine([ModelRunner(small, "small"), ModelRunner(large, "large")], tokenizer, launcher=launcher)
    waits = {label: 0.0 if wait is None else wait for label, (_, wait, _) in ROUTINGS.items()}
    runs, errors = measure(engine, [5, 6, 7], [1, 4], 6, 1, waits)
    ragged = {label for label in ROUTINGS if ragged_mode(label) == "on"}
    flying = {label for label, (_, _, flight) in ROUTINGS.items() if flight} - ragged
    ahead = {label for label in ROUTINGS if ", launched ahead" in label}
    assert set(errors) == flying | ragged | ahead and launcher.launched >= len(flying)
    assert all("illegal memory access" in errors[label] for label in flying)
    assert all("need static KV storage" in errors[label] for label in ragged)  # ModelRunners here
    assert all("launch_ahead needs M_S on static KV" in errors[label] for label in ahead)
    assert set(runs) == set(ROUTINGS) - flying - ragged - ahead
    assert all(figures["tok_per_s"] > 0 for row in runs.values() for figures in row.values())
    assert not engine.has_work() and not engine.live_ids() and not engine.flights.busy


def _static_engine():
    torch.manual_seed(0)
    (small, large), tokenizer = tiny_pair()
    runners = [
        StaticRunner(m, n, kv_budget_tokens=16 * 128, max_len=128) for m, n in ((small, "small"), (large, "large"))
    ]
    return BackoffEngine(runners, tokenizer), runners


def test_the_ragged_rows_run_m_ls_catch_ups_ragged_and_only_those():
    """Over static KV (the CPU: no graphs to capture, no timings), ", ragged" rows run M_L's
    catch-ups as ragged forwards ("on"); ", padded" rows ("off") and the default rows ("auto":
    ragged only where timed faster, so nowhere without graphs), and the engine after measure,
    padded. measure runs the rows asked for, in that order, handing what it has after each."""
    engine, runners = _static_engine()
    seen, inner = [], runners[1]._forward.ragged
    runners[1]._forward.ragged = lambda batch: seen.append(batch.input_ids.shape[0]) or inner(batch)
    labels = ("random b=0.9", "random b=0.9, padded", "random b=0.9, ragged", "random b=0.9, ragged, in flight")
    assert [ragged_mode(label) for label in labels] == ["auto", "off", "on", "on"]
    for label in labels:
        routing, wait, flight = ROUTINGS[label]
        before = len(seen)
        _ragged(engine, ragged_mode(label))
        got = throughput(engine, [5, 6, 7], 8, 12, routing, 1, 40.0 if wait is None else wait, flight)
        assert got["tok_per_s"] > 0
        assert (len(seen) > before) == (ragged_mode(label) == "on"), label
    saved, checks = [], {}  # after every row, what is measured so far (the stage saves it then)
    picked = ["random b=0.9, ragged", "always-small"]
    runs, errors = measure(
        engine, [5, 6, 7], [2], 4, 1, dict.fromkeys(ROUTINGS, 40.0), picked, lambda r, e: saved.append(list(r)), checks
    )
    assert list(runs) == picked and errors == {} and saved == [picked[:1], picked]
    assert runners[1].ragged is False
    assert checks["ragged_rel_err"] < 1e-5  # float32: the ragged catch-up's logits are the padded path's


def test_the_launched_ahead_rows_take_m_ss_steps_launched_ahead():
    """ ", launched ahead" rows (engine launch_ahead, over static KV): M_S's steps run on rows
    launched in the step before, and measure leaves the engine as it found it."""
    engine, _ = _static_engine()
    for label in ("random b=0.9, launched ahead", "always-small, launched ahead"):
        routing, wait, flight = ROUTINGS[label]
        got = throughput(engine, [5, 6, 7], 8, 12, routing, 1, 40.0, flight, ahead=True)
        assert got["tok_per_s"] > 0 and engine.launch_ahead and engine.ahead.rows_used > 0
    picked = ["random b=0.9, launched ahead", "random b=0.9"]
    runs, errors = measure(engine, [5, 6, 7], [2], 4, 1, dict.fromkeys(ROUTINGS, 40.0), picked)
    assert list(runs) == picked and errors == {} and not engine.launch_ahead


def test_a_ragged_forward_that_is_fast_and_wrong_is_flagged_before_its_row_is_timed(capsys):
    """The batch stage measures ragged catch-ups before any test has run them on the GPU: the
    first ragged row puts their logits against the padded path's, and a wrong one (here its
    logits negated) is flagged in the results beside its timing."""
    engine, runners = _static_engine()
    inner = runners[1]._forward.ragged
    runners[1]._forward.ragged = lambda batch: -inner(batch)
    checks = {}
    picked = ["random b=0.9, ragged", "random b=0.9, ragged, in flight"]
    runs, errors = measure(engine, [5, 6, 7], [2], 4, 1, dict.fromkeys(ROUTINGS, 40.0), picked, None, checks)
    assert checks["ragged_rel_err"] == pytest.approx(2.0, rel=1e-4) and checks["ragged_rel_err"] > RAGGED_TOLERANCE
    assert "relative error 2.0000 (over 0.1: suspect)" in capsys.readouterr().out
    assert list(runs) == picked and errors == {}  # checked once, then both rows timed


def test_a_ragged_check_that_raises_costs_its_rows_and_no_slot():
    """A ragged forward that raises in the check (a first kernel on a new GPU): the ragged rows
    are reported, the probe's sessions closed, and a later row still fits its streams in the
    slots (16 here)."""
    engine, runners = _static_engine()

    def broken(batch):
        raise RuntimeError("CUDA error: misaligned address")

    runners[1]._forward.ragged = broken
    picked = ["random b=0.9, ragged", "random b=0.9, ragged, in flight", "random b=0.9"]
    runs, errors = measure(engine, [5, 6, 7], [16], 4, 1, dict.fromkeys(ROUTINGS, 40.0), picked)
    assert set(errors) == set(picked[:2]) and all("misaligned address" in e for e in errors.values())
    assert list(runs) == ["random b=0.9"] and runs["random b=0.9"]["16"]["tok_per_s"] > 0
    assert runners[1].request_ids() == [] and runners[1].ragged is False


def test_the_batch_stage_names_rows_that_exist():
    """scripts/gpu_bench.sh batch runs a chosen set of rows by label, in their order: each must be
    a row (a typo would stop the stage at its argument check, on a GPU's time)."""
    import re
    from pathlib import Path

    script = (Path(__file__).parents[2] / "scripts" / "gpu_bench.sh").read_text()
    block = re.search(r"rows=\((.*?)\)", script, re.S).group(1)
    labels = re.findall(r'"([^"]+)"', block)
    assert len(labels) == 7 and set(labels) <= set(ROUTINGS)
    assert labels[0] == "random b=0.9"  # the goal's row first (the default, "auto"): a cut-off run keeps it
    assert labels[1] == "random b=0.9, launched ahead"  # the lever no GPU has run, next
    assert {ragged_mode(label) for label in labels} == {"auto", "off", "on"}  # the default beside both of its choices


def test_the_report_names_m_ls_graphs_at_load_and_row_by_row():
    """M_L's graphs as each row ran: at load the ragged plan (the ragged buckets' graphs, here
    the five that fit, in place of a padded kind: a tight budget); the padded row captures the
    padded plan's, and the rows after it keep them, so the report says so."""
    engine, runners = _static_engine()
    large = runners[1]
    large.ragged, large.ragged_if_faster = True, True  # KVSpec ragged "auto", the default on CUDA
    large.graphs = EagerGraphs(large._forward, large.graph_max_rows, K_BUCKETS[-1])
    large.warmup(progress=False, budget=74)  # every padded kind would take 90
    at_load = _large_graphs(engine)
    assert at_load == {"padded": 60, "ragged": 5}
    checks = {}
    picked = ["random b=0.9", "random b=0.9, padded", "random b=0.9, in flight"]
    runs, errors = measure(engine, [5, 6, 7], [2], 4, 1, dict.fromkeys(ROUTINGS, 40.0), picked, None, checks)
    assert list(runs) == picked and errors == {}
    grown = {"padded": 70, "ragged": 5}  # the padded plan within 74
    assert checks["large_graphs"] == dict(zip(picked, [at_load, grown, grown]))
    caches = BackoffEngine([runners[0], ModelRunner(large.model, "large")], engine.tokenizer)
    assert _large_graphs(caches) is None  # per-session caches: no graphs


def test_one_streams_cells_repeat_repeats_one_and_rows_past_the_deadline_are_skipped(monkeypatch):
    """The stage's n = 1 cells repeat 16 times (a one-stream cell moves most run to run) and the
    others --repeats; a row that would start past `until` is skipped, named in errors, and the
    rows before it kept (gpu_bench.sh all gives each stage what is left of one device call)."""
    import time

    import benchmarks.batch_scaling as batch_scaling

    (small, large), tokenizer = tiny_pair()
    engine = BackoffEngine([ModelRunner(small, "small"), ModelRunner(large, "large")], tokenizer)
    calls = []

    def fake(engine, prompt_ids, n, tokens, routing, repeats, *rest):
        calls.append((n, repeats))
        return {"tok_per_s": 1.0}

    monkeypatch.setattr(batch_scaling, "throughput", fake)
    picked = ["random b=0.9", "always-large", "always-small"]
    until = time.perf_counter() + 0.5

    def after_row(runs, errors):  # the first row takes past the deadline
        time.sleep(max(0.0, until - time.perf_counter()) + 0.05)

    runs, errors = measure(
        engine, [5, 6, 7], [1, 4], 6, 2, dict.fromkeys(ROUTINGS, 40.0), picked, after_row, None, 16, until
    )
    assert list(runs) == ["random b=0.9"] and runs["random b=0.9"] == {"1": {"tok_per_s": 1.0}, "4": {"tok_per_s": 1.0}}
    assert errors == dict.fromkeys(picked[1:], "skipped: past the deadline")
    assert calls == [(2, 1), (1, 16), (4, 2)]  # the row's warm-up, then its cells
