"""benchmarks/gpu_sim.py: the engine's own forwards at a GPU run's measured costs. Its clock
is the forwards' costs and the host's, nothing else; the engine's waits read it; and at the
routings whose forwards the blocks layout did not change, it lands within 15% of what the
H100 measured (its third run, tests/fixtures/gpu_h100_run3), which is what makes its other
figures worth reading."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from backoff_core.engine.engine import CATCH_UP_WAIT_MS
from backoff_core.runners.graph_plan import GraphKey
from backoff_core.runners.static_ragged import RAGGED_TOKENS, RaggedKey
from benchmarks.gpu_costs import GpuCosts, measured_on
from benchmarks.gpu_sim import ROUTINGS, build, run_batch, run_sustained, validate
from benchmarks.gpu_sim_device import FAIR, AheadDevice, SimClock, SimLauncher
from benchmarks.gpu_sim_what_if import WaitsOffAtLive
from tests.support.gpu_runs import RUN3


@pytest.fixture(scope="module")
def sim():
    return build(GpuCosts.from_results(RUN3))


def test_the_clock_is_the_forwards_and_the_host():
    runs = [run_batch(build(GpuCosts.from_results(RUN3)), 8, 16, ROUTINGS["random b=0.9"][0]) for _ in range(2)]
    got = runs[0]
    assert got["large_forwards"] > 0 and got["small_forwards"] >= 16
    assert 1e3 * got["seconds"] == pytest.approx(got["large_ms"] + got["small_ms"] + got["host_ms"])
    assert runs[1] == got  # from the same state, the same figures: no wall clock in them
    assert 0 < got["drain_share"] < 1
    alone = run_batch(build(GpuCosts.from_results(RUN3)), 1, 16, ROUTINGS["random b=0.9"][0])
    assert alone["drain_share"] == 0  # one stream: its end is the first and the last


def test_the_engine_waits_by_the_simulated_clock(sim):
    routing = ROUTINGS["random b=0.9"][0]
    sim.engine.catch_up_wait_ms = 0.0
    at_once = run_batch(sim, 16, 32, routing)
    sim.engine.catch_up_wait_ms = 40.0  # ~15 simulated M_S steps of 16 streams
    batched = run_batch(sim, 16, 32, routing)
    sim.engine.catch_up_wait_ms = 1.0  # less than a step: nothing waits
    short = run_batch(sim, 16, 32, routing)
    assert batched["large_forwards"] < 0.6 * at_once["large_forwards"]
    assert short["large_forwards"] == at_once["large_forwards"]


@pytest.mark.parametrize("label", ["always-small", "always-large"])
@pytest.mark.parametrize("n", [1, 16])
def test_it_lands_near_what_the_h100_measured(sim, label, n):
    measured = json.loads((RUN3 / "batch_scaling-h100.json").read_text())["tok_per_s"][label][str(n)]
    routing = ROUTINGS[label][0]
    got = run_batch(sim, n, 64, routing)["tok_per_s"]
    assert 0.85 <= got / measured <= 1.15, (got, measured)


def test_a_step_launched_ahead_runs_on_the_device_beside_the_hosts_work():
    """AheadDevice by hand: a launch queues 2 ms and the host goes on; the next launch's read
    waits for it; a forward the host waits for starts once the device is free."""
    clock = SimClock()
    device = AheadDevice(clock)
    device.launched(2.0)
    assert (clock.t, device.free) == (0.0, pytest.approx(0.002))
    clock.advance(1.5)  # the host's work after the read, beside the launched forward
    device.launched(2.0)  # its read waits for the first launch: 0.5 ms of the host idle
    assert (clock.t, device.free) == (pytest.approx(0.002), pytest.approx(0.004))
    clock.advance(3.0)  # more host work than the forward: the device idles instead
    device.then(clock.advance)(1.0)  # a catch-up: the host waits for it
    assert clock.t == pytest.approx(0.006) and device.launches == 2


def test_launched_ahead_the_host_hides_behind_m_ss_forwards(sim):
    """always-small, 8 streams: the same steps, one more M_S forward (the last launch, taken by
    nobody), and the wall between the device's bound (every forward end to end) and the run
    without (forwards and host in turn); random b=0.9 runs more steps (a request caught up rides
    the next launch) and still less wall."""
    for label in ("always-small", "random b=0.9"):
        routing = ROUTINGS[label][0]
        plain = run_batch(sim, 8, 16, routing)
        sim.engine.launch_ahead = True
        try:
            ahead = run_batch(sim, 8, 16, routing)
        finally:
            sim.engine.launch_ahead = False
        assert ahead["seconds"] < plain["seconds"]
        # the device's bound; it can be met exactly, so within float rounding (the clock's seconds
        # are a difference of two absolute times, whose last bits depend on the tests run before)
        assert 1e3 * ahead["seconds"] >= ahead["small_ms"] + ahead["large_ms"] - 1e-6  # as one_gpu below
        if label == "always-small":
            assert ahead["steps"] == plain["steps"] and ahead["small_forwards"] == plain["small_forwards"] + 1
        else:
            assert ahead["steps"] >= plain["steps"]


def test_streams_kept_busy_pay_their_admissions(sim):
    """run_sustained: a stream's next request is submitted when its last ends, its prompt
    prefill on the clock, so always-small keeps fewer tok/s than a batch admitted before the
    clock starts; nothing is left live."""
    routing = ROUTINGS["always-small"][0]
    kept_busy = run_sustained(sim, 8, 16, routing)
    batch = run_batch(sim, 8, 16, routing)["tok_per_s"]
    assert 0.3 * batch < kept_busy["tok_per_s"] < batch
    assert sim.engine.live_ids() == []
    split = kept_busy["ms"]  # always-small: no M_L; the admissions' prefills are paid on the clock
    assert split["M_L"] == 0 and split["M_S prefills"] > 0 and split["M_S steps"] > split["M_S prefills"]
    assert sum(split.values()) == pytest.approx(1e3 * kept_busy["seconds"], abs=0.3)  # all of the window


def test_what_if_unpadded_prices_m_l_forwards_by_their_real_tokens():
    """--what-if unpadded: an M_L forward at the measured dense view with the fewest token
    slots that hold its real tokens (no padding, no gathering), and the clock charges
    whatever price build() is given."""
    costs = GpuCosts.from_results(RUN3)
    gathered = GraphKey(False, 64, 8, 256, True, None)  # 512 slots, 100 of them real
    fewest = min((r * k, ms) for (d, r, k, n), ms in costs.large.items() if d and n == 256 and r * k >= 100)
    assert fewest[0] == 128 and costs.unpadded_ms(gathered, 100, False) == fewest[1]
    assert costs.unpadded_ms(gathered, 100, False) < costs.large_ms(gathered, 100, False)
    flat = run_batch(build(costs, large_cost=lambda key, real, eager: 1.0), 8, 16, ROUTINGS["random b=0.9"][0])
    assert flat["large_ms"] == flat["large_forwards"] > 0


def test_what_if_ragged_runs_m_ls_catch_ups_as_ragged_forwards_at_their_buckets_price():
    """--what-if ragged: the engine's M_L catch-ups of several tokens are ragged forwards
    (static_ragged.py), each on the clock at its token bucket's price; steps of one token a
    row keep their padded graph. At 16 streams the ragged catch-ups read fewer slots than the
    padded ones and, priced so, finish sooner."""
    costs = GpuCosts.from_results(RUN3)
    routing = ROUTINGS["random b=0.9"][0]
    padded, ragged = (run_batch(build(costs, ragged=r), 16, 32, routing) for r in ("off", "on"))
    shapes = ragged["large_by_shape"]
    assert shapes and all(name.startswith("ragged ") for name in shapes)
    for name, s in shapes.items():
        tokens = int(name.split()[1])
        assert s["ms"] == pytest.approx(s["count"] * costs.ragged_ms(tokens)) and s["real"] <= s["count"] * tokens
    assert not any(name.startswith("ragged") for name in padded["large_by_shape"])
    assert ragged["large_real_share"] > padded["large_real_share"] and ragged["seconds"] < padded["seconds"]


def test_auto_the_default_takes_whichever_its_prices_say():
    """KVSpec ragged "auto" (build's default, the engine's on CUDA): each catch-up ragged where
    its ragged forwards are priced lower than its padded layout. At the dense-view estimate
    (no GPU has timed a ragged forward yet) that is every catch-up ragged, the "on" run's
    forwards exactly; with ragged forwards priced far dearer, none, and about the padded ("off")
    run's time (less the k = 16 last-logits graphs whose budget ragged's took: graph_plan)."""
    costs = GpuCosts.from_results(RUN3)
    routing = ROUTINGS["random b=0.9"][0]

    def shapes(c, mode):
        got = run_batch(build(c, ragged=mode), 16, 32, routing)
        return got["seconds"], {name: s["count"] for name, s in got["large_by_shape"].items()}

    assert shapes(costs, "auto") == shapes(costs, "on")
    dear = dataclasses.replace(costs, ragged={t: 1e3 for t in RAGGED_TOKENS})
    seconds, forwards = shapes(dear, "auto")
    assert forwards and not any(name.startswith("ragged") for name in forwards)
    assert seconds == pytest.approx(shapes(dear, "off")[0], rel=0.03)


def test_catch_ups_in_flight_run_on_m_ls_own_timeline(sim):
    """In flight (SimLauncher), M_L's forwards no longer add to the loop's clock, which still
    holds every M_S step and the host; a lone request waits for each of its flights, so its
    time is the synchronous loop's."""
    routing = ROUTINGS["random b=0.9"][0]
    sim.engine.catch_up_wait_ms = 0.0
    sync = run_batch(sim, 16, 32, routing)
    sync_alone = run_batch(sim, 1, 32, routing)
    sim.engine.overlap_catch_ups = True
    try:
        flying = run_batch(sim, 16, 32, routing)
        alone = run_batch(sim, 1, 32, routing)
    finally:
        sim.engine.overlap_catch_ups = False
        sim.engine.catch_up_wait_ms = CATCH_UP_WAIT_MS
    assert 1e3 * sync["seconds"] == pytest.approx(sync["large_ms"] + sync["small_ms"] + sync["host_ms"])
    assert flying["small_ms"] + flying["host_ms"] <= 1e3 * flying["seconds"]
    assert 1e3 * flying["seconds"] < flying["large_ms"] + flying["small_ms"] + flying["host_ms"]
    assert flying["tok_per_s"] > sync["tok_per_s"]
    assert alone["tok_per_s"] == pytest.approx(sync_alone["tok_per_s"])


def test_a_shared_gpu_splits_the_device_between_a_flight_and_m_ss_steps():
    """SimLauncher(sharing=FAIR), by hand: an M_S forward beside a flight runs at half speed
    while the flight has work left, and pushes the flight's end by the time they shared."""
    clock = SimClock()
    launcher = SimLauncher(clock, FAIR)
    flight = launcher.submit(lambda: launcher.advance(10.0) or {})  # 10 ms of M_L from t = 0
    assert flight.end == pytest.approx(0.010) and clock.t == 0
    launcher.small(3.0)  # 3 ms beside it: 6 ms, the flight 3 ms later
    assert clock.t == pytest.approx(0.006) and flight.end == pytest.approx(0.013)
    launcher.small(20.0)  # 7 ms of M_L left: 14 ms shared, then 13 ms alone
    assert clock.t == pytest.approx(0.033) and flight.end == pytest.approx(0.020) and flight.done()
    launcher.small(2.0)  # landed: alone
    assert clock.t == pytest.approx(0.035)
    apart = SimLauncher(SimClock())
    apart.submit(lambda: apart.advance(10.0) or {})
    apart.small(3.0)
    assert apart.clock.t == pytest.approx(0.003) and apart.out.end == pytest.approx(0.010)


def test_measured_slowdowns_price_the_sharing():
    """SimLauncher(sharing=(a, b)) by hand, M_S 1.5x slower beside M_L and M_L 3x slower
    beside M_S (what gpu_check.json's `sharing` probe measures): each side's work is done at
    its slowed rate while both run, at full rate after."""
    clock = SimClock()
    launcher = SimLauncher(clock, (1.5, 3.0))
    flight = launcher.submit(lambda: launcher.advance(10.0) or {})
    launcher.small(3.0)  # 4.5 ms beside it; M_L did 1.5 of its 10 ms: ends at 4.5 + 8.5
    assert clock.t == pytest.approx(0.0045) and flight.end == pytest.approx(0.013)
    launcher.small(20.0)  # 8.5 ms of M_L left take 25.5 ms beside M_S, which did 17 of its 20
    assert flight.end == pytest.approx(0.030) and clock.t == pytest.approx(0.033)


def test_gpu_costs_read_the_sharing_probe(tmp_path):
    """GpuCosts.sharing: gpu_check.json's `sharing` (M_S's and M_L's slowdowns side by side),
    None where the run has none or the probe failed (--what-if shared then prices it fairly);
    sharing_first: its `first` entries (the loop's or the flight's stream first), where measured."""
    for name in ("gpu_check.json", "catch_up_anatomy.json"):
        (tmp_path / name).write_text((RUN3 / name).read_text())
    check = json.loads((tmp_path / "gpu_check.json").read_text())
    assert GpuCosts.from_results(tmp_path).sharing is None
    check["sharing"] = "failed: RuntimeError('x')"
    (tmp_path / "gpu_check.json").write_text(json.dumps(check))
    assert GpuCosts.from_results(tmp_path).sharing is None
    check["sharing"] = {"small_slowdown": 1.25, "large_slowdown": 1.1}
    (tmp_path / "gpu_check.json").write_text(json.dumps(check))
    assert GpuCosts.from_results(tmp_path).sharing == (1.25, 1.1)
    assert GpuCosts.from_results(tmp_path).sharing_first == {}
    check["sharing"]["first"] = {
        "loop": {"small_slowdown": 1.05, "large_slowdown": 1.2},
        "flight": {"small_slowdown": 1.8, "large_slowdown": 1.0},
    }
    (tmp_path / "gpu_check.json").write_text(json.dumps(check))
    costs = GpuCosts.from_results(tmp_path)
    assert costs.sharing == (1.25, 1.1) and costs.sharing_first == {"loop": (1.05, 1.2), "flight": (1.8, 1.0)}


def test_in_flight_on_a_shared_gpu_keeps_the_device_busy_at_most_all_the_time():
    """--what-if shared: with the device shared, the loop's time holds at least all of the
    device's work (M_S's and M_L's forwards), and in flight is slower than on two timelines."""
    routing = ROUTINGS["random b=0.9"][0]
    figures = {}
    for shared in (False, True):
        sim = build(GpuCosts.from_results(RUN3), wait_ms=0.0, sharing=FAIR if shared else None)
        sim.engine.overlap_catch_ups = True
        figures[shared] = run_batch(sim, 16, 32, routing)
    one_gpu = figures[True]
    assert one_gpu["large_forwards"] > 0 and figures[False]["large_forwards"] > 0
    assert 1e3 * one_gpu["seconds"] >= one_gpu["small_ms"] + one_gpu["large_ms"] - 1e-6
    assert one_gpu["tok_per_s"] < figures[False]["tok_per_s"]


def test_the_simulation_is_set_beside_the_same_gpus_throughput(tmp_path):
    """gpu_sim's `sim_over_gpu_run` reads the batch_scaling file the costs' GPU measured, none
    where that GPU measured none (an H200's costs are never set beside an H100's tok/s); the
    batch stage's own file before a rerun of some of its rows under a longer tag."""
    for tag, gpu in (("h100", "NVIDIA H100 80GB HBM3"), ("h200", "NVIDIA H200"), ("h200-repeats5", "NVIDIA H200")):
        (tmp_path / f"batch_scaling-{tag}.json").write_text(json.dumps({"gpu": gpu, "tok_per_s": {}}))
    assert measured_on(tmp_path, "NVIDIA H200") == tmp_path / "batch_scaling-h200.json"
    assert measured_on(RUN3, GpuCosts.from_results(RUN3).gpu) == RUN3 / "batch_scaling-h100.json"
    assert measured_on(tmp_path, "NVIDIA A100-SXM4-80GB") is None
    assert validate({"always-small": {"1": {"tok_per_s": 1.0}}}, None) == {}


def test_gpu_costs_warn_where_two_gpus_costs_mix(tmp_path):
    """A `batch` stage alone on another GPU brings a new M_L grid (catch_up_anatomy.json) beside
    the last `tests` stage's M_S costs (gpu_check.json): said, loudly, and named in the source."""
    for name in ("gpu_check.json", "catch_up_anatomy.json"):
        (tmp_path / name).write_text((RUN3 / name).read_text())
    anatomy = json.loads((tmp_path / "catch_up_anatomy.json").read_text())
    anatomy["gpu"] = GpuCosts.from_results(RUN3).gpu
    (tmp_path / "catch_up_anatomy.json").write_text(json.dumps(anatomy))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "MIXED" not in GpuCosts.from_results(tmp_path).source  # one GPU
    anatomy["gpu"] = "NVIDIA H200"
    (tmp_path / "catch_up_anatomy.json").write_text(json.dumps(anatomy))
    with pytest.warns(UserWarning, match="two GPUs' costs mixed: M_L's grid from NVIDIA H200"):
        costs = GpuCosts.from_results(tmp_path)
    assert "MIXED" in costs.source and costs.gpu == "NVIDIA H100 80GB HBM3"


def test_another_cards_m_l_is_the_runs_forwards_scaled_and_m_s_kept():
    """GpuCosts.scaled (gpu_sim --large-scale): M_L's forwards (graphs, eager, ragged timed or estimated) at a share
    of the run's times, M_S's steps and the host as measured; 1 is the run itself."""
    costs = GpuCosts.from_results(RUN3)
    assert costs.scaled(1.0) is costs
    half = dataclasses.replace(costs, ragged={64: 8.0}).scaled(0.5)
    key = GraphKey(False, 16, 8, 256, True, None)
    assert half.large_ms(key, 100, eager=True) == pytest.approx(0.5 * costs.large_ms(key, 100, eager=True))
    assert half.large_ms(RaggedKey(64), 50, False) == 4.0  # timed by the probe
    assert half.large_ms(RaggedKey(128), 100, False) == pytest.approx(0.5 * costs.ragged_ms(128))  # estimated
    assert half.small_rows == costs.small_rows and half.host_ms == costs.host_ms
    assert "x0.5" in half.source


def test_what_if_waits_off_at_live_catches_up_at_once_at_or_below_its_count():
    routing = ROUTINGS["random b=0.9"][0]
    runs = {}
    for off_at in (None, 8, 7):
        sim = build(GpuCosts.from_results(RUN3))
        if off_at is not None:
            sim.engine.hold = WaitsOffAtLive(sim.engine.hold, off_at)
        runs[off_at] = run_batch(sim, 8, 32, routing)
    at_once = build(GpuCosts.from_results(RUN3), wait_ms=0.0)
    assert run_batch(at_once, 8, 32, routing)["large_forwards"] == runs[8]["large_forwards"]  # never waits
    assert runs[8]["steps"] == 32  # no step without every live request
    assert runs[None]["large_forwards"] < runs[7]["large_forwards"] < runs[8]["large_forwards"]  # the drain alone
