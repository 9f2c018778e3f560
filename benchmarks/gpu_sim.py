"""The engine's scheduling at a GPU's measured costs, on the CPU: what n streams would reach.

    python benchmarks/gpu_sim.py                         # the H100 costs, every routing, n = 1..64
    python benchmarks/gpu_sim.py --streams 64 --check    # and the shapes against catch_up_anatomy's run
    python benchmarks/gpu_sim.py --sustained             # and n streams kept busy (a load tester's view)

Batch scaling on a GPU depends on *which* forwards the step loop runs (how many M_L
catch-ups, at which rows x k x L, how many M_S steps) and on what each costs. The first is
the engine's code, and it runs here for real: a BackoffEngine over StaticRunners with the
GPU's layouts and graph plan (tiny random models stand in for the weights; graphs replay
eagerly), routing with the random router's seeded coins exactly as on the GPU. The second
comes from a GPU run: every forward advances a simulated clock by the replay time the GPU
measured for its bucket (gpu_check.json's `replay_ms` of every graph where the run saved it;
before that, catch_up_anatomy.json's M_L grid, with gathered batches past the grid's rows
estimated, and gpu_check.json's M_S step anatomy), eager forwards by a measured cost, and
each step by a host time fitted to that run (gpu_costs.py). The engine reads that clock (its
catch-up waits are bounded in time), so its decisions are the ones it would take at the
GPU's pace.

Catch-ups in flight (engine `overlap_catch_ups`, the rows "in flight"): SimLauncher puts
M_L's forwards on a timeline of their own, beside the loop's (M_S's steps and the host).
That is exact for M_L on a GPU of its own and the best case on one GPU, where M_S's kernels
and M_L's share the SMs: only a GPU run tells how much of it one GPU keeps. `--what-if
shared` models that sharing: each slowed beside the other as gpu_check.json's `sharing`
probe measured, else fairly (each at half speed while both run).

What it is for: choosing between scheduling policies (batched catch-ups' bounds, layouts)
before a GPU is at hand, and telling what the next GPU run should see. It is a model. The
figures of the GPU run it reads were measured on that run's checkout: where this checkout
runs other forwards (a changed layout or policy), `sim_over_gpu_run` is the predicted change,
not an error; at routings whose forwards did not change it is the model's error
(tests/benchmarks/test_gpu_sim.py holds always-small and always-large within 15%).
`--check` sets the M_L forwards of 64 streams at b=0.9 beside the GPU run's
(catch_up_anatomy.json). Deterministic: the clock is the costs, not the wall, so two
checkouts compare exactly on any machine. Writes benchmarks/results/gpu_sim.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from backoff_core.engine.engine import CATCH_UP_WAIT_MS, BackoffEngine
from backoff_core.runners.graph_plan import K_BUCKETS, GraphKey
from backoff_core.runners.static import StaticRunner
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.batch_scaling import launched_ahead, set_overlaps  # noqa: E402
from benchmarks.batch_scaling_report import plot_scaling  # noqa: E402
from benchmarks.gpu_costs import GPU_RESULTS, GpuCosts, measured_on  # noqa: E402
from benchmarks.gpu_sim_device import (  # noqa: E402
    FAIR,
    AheadDevice,
    ForwardLog,
    SimClock,
    SimGraphs,
    SimLauncher,
    instrument,
)
from benchmarks.gpu_sim_report import print_report, validate  # noqa: E402
from benchmarks.gpu_sim_what_if import WHAT_IF, WaitsOffAtLive, ragged_mode  # noqa: E402
from benchmarks.step_overhead import tiny_pair  # noqa: E402

PROMPT_TOKENS = 43  # the batch benchmarks' prompt in the GPU pair's tokenizer (chat template)


@dataclass
class Sim:
    engine: BackoffEngine
    clock: SimClock
    small: ForwardLog
    large: ForwardLog
    costs: GpuCosts
    device: AheadDevice  # M_S's steps launched ahead (engine launch_ahead)


def build(
    costs: GpuCosts,
    kv_budget: int = 65536,
    max_len: int = 1024,
    wait_ms: float = CATCH_UP_WAIT_MS,
    large_cost: Callable[[GraphKey, int, bool], float] | None = None,
    sharing: tuple[float, float] | None = None,
    ragged: str = "auto",
) -> Sim:
    """The engine over the GPU path's runners (factory.make_runner's settings), on the CPU;
    its catch-ups in flight (when turned on) are SimLauncher's (sharing: on one GPU with
    M_S's steps, their slowdowns beside each other). large_cost: what an M_L forward costs
    (default: costs.large_ms, what the GPU measured). ragged: M_L's catch-ups as ragged
    forwards (static_ragged.py), each costing large_cost of its RaggedKey, as KVSpec.ragged
    has it on CUDA: "auto" (the default: each catch-up ragged where its forwards' prices are
    lower than its padded layout's), "on" (wherever they apply), "off"."""
    large_cost = large_cost or costs.large_ms
    (small_model, large_model), tokenizer = tiny_pair()  # their tokens do not matter: random routing
    clock = SimClock()
    runners = []
    small_cost = lambda key, real, eager: costs.small_ms(key, eager)  # noqa: E731
    for model, name, small in ((small_model, "small", True), (large_model, "large", False)):
        runner = StaticRunner(
            model,
            name,
            kv_budget_tokens=kv_budget,
            max_len=max_len,
            evict_idle=not small,
            fuse_projections=small,
            ragged=ragged != "off" and not small,
            ragged_if_faster=ragged == "auto",
        )
        if runner.ragged:  # its tokens do not matter: skip eager FlexAttention's every score, and warmup's check
            runner._forward._flex = _no_attention
            runner.ragged_rel_err = lambda prompt_ids=None: 0.0
        cost = small_cost if small else large_cost
        runner.graphs = SimGraphs(runner._forward, runner.graph_max_rows, K_BUCKETS[-1], cost=cost)
        if small:
            runner.warmup(last_only=(True,), ks=(1, 2), progress=False)
        else:
            runner.warmup(progress=False)
        runners.append(runner)
    launcher = SimLauncher(clock, sharing)
    device = AheadDevice(clock)  # a no-op until a step is launched ahead
    small_log = instrument(runners[0], device.then(launcher.small), small_cost, device.launched)
    large_log = instrument(runners[1], device.then(launcher.advance), large_cost)
    engine = BackoffEngine(runners, tokenizer, catch_up_wait_ms=wait_ms, clock=clock.now, launcher=launcher)
    return Sim(engine, clock, small_log, large_log, costs, device)


def _no_attention(q, keys, values, block_mask, scale):
    """The ragged forward's attention in the simulator, where only shapes and bookkeeping count."""
    return torch.zeros_like(q)


B09 = RoutingParams(router="random", rate=0.9)
ROUTINGS = {  # label -> (routing, catch_up_wait_ms: None keeps the engine's, overlap_catch_ups)
    "always-large": (RoutingParams(router="always-large"), None, False),
    "random b=0.9": (B09, None, False),
    "random b=0.9, catch-ups at once": (B09, 0.0, False),
    "random b=0.9, in flight": (B09, 0.0, True),
    "random b=0.9, held and in flight": (B09, None, True),
    "random b=0.9, launched ahead": (B09, None, False),
    "always-small": (RoutingParams(router="always-small"), None, False),
    "always-small, launched ahead": (RoutingParams(router="always-small"), None, False),
}


def _configure(engine: BackoffEngine, wait: float | None = None, overlap: bool = False, label: str = "") -> None:
    """A row's settings; ", launched ahead" rows: the engine's launch_ahead (AheadDevice times it)."""
    engine.catch_up_wait_ms = CATCH_UP_WAIT_MS if wait is None else wait
    set_overlaps(engine, overlap, launched_ahead(label))


def _stepping(engine: BackoffEngine) -> int:
    """The requests a step is about to step (live, not waiting for a batched catch-up)."""
    return sum(1 for r in engine._live.values() if not r.done and r.waiting is None)


def _host_ms(costs: GpuCosts, stepping: int, catch_ups: int) -> float:
    """A step's host work (GpuCosts: fitted to the run's step_timeline.json where it has one)."""
    return costs.host_ms + costs.host_ms_per_row * stepping + costs.host_ms_per_catch_up * catch_ups


def _read(sim: Sim, launches: int) -> None:
    """After a step: its read waited for the device, unless the step launched M_S's next
    forward (AheadDevice.launched then waited for the one before)."""
    if sim.device.launches == launches:
        sim.device.sync()


def run_batch(sim: Sim, n: int, tokens: int, routing: RoutingParams, seed: int = 0) -> dict:
    """n requests of `tokens` tokens together, as batch_scaling.py runs them (admission
    outside the clock): simulated tok/s and the forwards' record."""
    engine, costs = sim.engine, sim.costs
    prompt = tuple(range(2, 2 + PROMPT_TOKENS))
    requests = [
        GenerationRequest(prompt, SamplingParams(max_tokens=tokens, seed=seed * 1000 + i, ignore_eos=True), routing)
        for i in range(n)
    ]
    rids = [engine.submit(r) for r in requests]
    sim.small.entries.clear()
    sim.large.entries.clear()
    start = sim.clock.t
    steps, host_ms, first_end = 0, 0.0, None
    while engine.has_work():
        catch_ups, launches = len(sim.large.entries), sim.device.launches
        stepping = _stepping(engine)
        engine.step()
        steps += 1
        _read(sim, launches)
        host = _host_ms(costs, stepping, len(sim.large.entries) - catch_ups)
        sim.clock.advance(host)
        host_ms += host
        if first_end is None and engine.finished_ids():
            first_end = sim.clock.t
    sim.device.sync()  # batch_scaling's clock ends synchronized (a last launch, taken by nobody)
    seconds = sim.clock.t - start
    done = sum(len(engine.finish(r).token_ids) for r in rids)
    large_ms = sum(e[-1] for e in sim.large.entries)
    small_ms = sum(e[-1] for e in sim.small.entries)
    return {
        "tok_per_s": done / seconds,
        "seconds": seconds,
        "steps": steps,
        "large_forwards": len(sim.large.entries),
        "large_ms": large_ms,
        "small_forwards": len(sim.small.entries),
        "small_ms": small_ms,
        "host_ms": host_ms,
        # the drain: after the first request ends, fewer streams are left to share the forwards
        "drain_share": (sim.clock.t - first_end) / seconds,
        "large_real_share": sum(e[5] for e in sim.large.entries) / max(1, sum(e[1] * e[2] for e in sim.large.entries)),
        "large_by_shape": sim.large.by_shape(),
    }


def scaling(sim: Sim, streams: list[int], tokens: int, repeats: int, labels: list[str] | None = None) -> dict:
    """Rows of ROUTINGS (labels; default every one) at every n: the median run of `repeats`
    seeds, with the median tok/s."""
    rows: dict[str, dict[str, dict]] = {}
    picked = {label: ROUTINGS[label] for label in labels} if labels is not None else ROUTINGS
    for label, (routing, wait, overlap) in tqdm(picked.items(), desc="routings", disable=len(picked) == 1):
        _configure(sim.engine, wait, overlap, label)
        rows[label] = {}
        for n in streams:
            runs = [run_batch(sim, n, tokens, routing, seed) for seed in range(repeats)]
            best = sorted(runs, key=lambda r: r["tok_per_s"])[len(runs) // 2]  # the median run
            rows[label][str(n)] = {**best, "tok_per_s": statistics.median(r["tok_per_s"] for r in runs)}
    _configure(sim.engine)
    return rows


def run_sustained(sim: Sim, n: int, tokens: int, routing: RoutingParams, requests_per_stream: int = 4) -> dict:
    """n streams kept busy, as a load tester's fixed concurrency does (guidellm's
    `concurrent`): when a request ends its stream submits the next, admission on the clock,
    the requests that end in one step admitted together (one prefill forward, as the serving
    loop admits what arrived between two steps: engine_loop._admit_all). Simulated tok/s of
    the tokens finished between the first n ends and the first moment fewer than n are live
    (the start and the drain left out), and where that time went (ms): M_S's steps, M_S's
    prompt prefills, M_L, the host."""
    engine, costs = sim.engine, sim.costs
    prompt = tuple(range(2, 2 + PROMPT_TOKENS))
    seeds = iter(range(10**9))
    split = dict.fromkeys(("M_S steps", "M_S prefills", "M_L", "host"), 0.0)
    counting = False

    def submit(count: int) -> list[str]:
        params = [SamplingParams(max_tokens=tokens, seed=next(seeds), ignore_eos=True) for _ in range(count)]
        before = len(sim.small.entries)
        request_ids = engine.submit_many([GenerationRequest(prompt, p, routing) for p in params])
        if counting:
            split["M_S prefills"] += sum(e[-1] for e in sim.small.entries[before:])
        return request_ids

    total = max(2, requests_per_stream) * n
    live = set(submit(n))
    submitted, ended, counted, start = n, 0, 0, None
    while len(live) == n:
        small, large, launches = len(sim.small.entries), len(sim.large.entries), sim.device.launches
        stepping = _stepping(engine)
        engine.step()
        _read(sim, launches)
        host = _host_ms(costs, stepping, len(sim.large.entries) - large)
        sim.clock.advance(host)
        if counting:
            split["M_S steps"] += sum(e[-1] for e in sim.small.entries[small:])
            split["M_L"] += sum(e[-1] for e in sim.large.entries[large:])
            split["host"] += host
        for request_id in engine.finished_ids():
            live.discard(request_id)
            done = len(engine.finish(request_id).token_ids)
            ended += 1
            if start is not None:
                counted += done
            elif ended == n:
                start, counting = sim.clock.t, True
        more = min(n - len(live), total - submitted)
        if more:
            live.update(submit(more))
            submitted += more
    seconds = sim.clock.t - start
    for request_id in engine.live_ids():
        engine.cancel(request_id)
    while engine.has_work():  # a flight still out lands (and closes what it holds)
        engine.step()
    return {"tok_per_s": counted / seconds, "seconds": seconds, "ms": {k: round(v, 1) for k, v in split.items()}}


def sustained(sim: Sim, streams: list[int], tokens: int) -> dict:
    out = {}
    for label, (routing, wait, overlap) in tqdm(ROUTINGS.items(), desc="sustained"):
        _configure(sim.engine, wait, overlap, label)
        out[label] = {str(n): run_sustained(sim, n, tokens, routing) for n in streams}
    _configure(sim.engine)
    return out


def check_shapes(sim: Sim, tokens: int, anatomy_path: Path) -> dict:
    """One run of 64 streams at b=0.9 (engine default) set beside the recorded GPU run's
    M_L forwards (catch_up_anatomy.json): how many, how many real tokens, their share of the
    slots."""
    recorded = json.loads(anatomy_path.read_text())
    out = {}
    for label, wait in (("batched", CATCH_UP_WAIT_MS), ("at once", 0.0)):
        sim.engine.catch_up_wait_ms = wait
        runs = [run_batch(sim, recorded["streams"], tokens, ROUTINGS["random b=0.9"][0], seed) for seed in range(3)]
        measured = recorded[label]["large"]
        out[label] = {
            "simulated": {
                "forwards": statistics.median(r["large_forwards"] for r in runs),
                "real_share": round(statistics.median(r["large_real_share"] for r in runs), 3),
                "ms": round(statistics.median(r["large_ms"] for r in runs), 1),
            },
            "gpu_run": {k: measured[k] for k in ("forwards", "real_share", "ms")} | {"gpu": recorded.get("gpu")},
        }
    sim.engine.catch_up_wait_ms = CATCH_UP_WAIT_MS
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,4,16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="seeds per cell (the median run is kept)")
    ap.add_argument("--costs", default=str(GPU_RESULTS), help="folder of the GPU run's json files")
    ap.add_argument("--check", action="store_true", help="also compare the M_L forwards with catch_up_anatomy's")
    ap.add_argument("--sustained", action="store_true", help="also n streams kept busy (run_sustained)")
    ap.add_argument("--what-if", nargs="+", choices=sorted(WHAT_IF), default=[], help="one or both of: " + str(WHAT_IF))
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--large-scale", type=float, default=1.0, help="M_L's forwards at this share (GpuCosts.scaled)")
    ap.add_argument(
        "--waits-off-at-live", type=int, metavar="X", help="what-if: " + WaitsOffAtLive.__doc__.split(": ", 1)[1]
    )
    args = ap.parse_args()
    costs = GpuCosts.from_results(Path(args.costs)).scaled(args.large_scale)
    sharing = (costs.sharing or FAIR) if "shared" in args.what_if else None
    sim = build(
        costs,
        large_cost=costs.unpadded_ms if "unpadded" in args.what_if else None,
        sharing=sharing,
        ragged=ragged_mode(args.what_if),
    )
    if args.waits_off_at_live is not None:
        sim.engine.hold = WaitsOffAtLive(sim.engine.hold, args.waits_off_at_live)
    streams = [int(s) for s in args.streams.split(",")]
    rows = scaling(sim, streams, args.tokens, args.repeats)
    base, top = str(streams[0]), str(streams[-1])
    report = {
        "what": "simulated: the engine's forwards on the CPU, each at the GPU's measured cost (gpu_sim.py)"
        + "".join(f"; what-if {name}: {WHAT_IF[name]}" for name in args.what_if)
        + (f"; what-if: no waits at <= {args.waits_off_at_live} live" if args.waits_off_at_live is not None else ""),
        "costs": costs.source,
        "sharing": sharing,  # (M_S's, M_L's slowdown beside the other) on one GPU; None: two timelines
        "host": {
            "ms": costs.host_ms,
            "ms_per_row": costs.host_ms_per_row,
            "ms_per_catch_up": costs.host_ms_per_catch_up,
        },
        "tokens": args.tokens,
        "tok_per_s": {label: {n: round(c["tok_per_s"], 1) for n, c in row.items()} for label, row in rows.items()},
        "scaling_vs_n1": {
            label: round(row[top]["tok_per_s"] / row[base]["tok_per_s"], 2) for label, row in rows.items()
        },
        "large_scale": args.large_scale,  # M_L's forwards at this share of the run's times
        # beside what the run measured, only at the run's own costs
        "sim_over_gpu_run": validate(rows, measured_on(Path(args.costs), costs.gpu)) if args.large_scale == 1 else {},
        "at_top_n": {
            label: {k: v for k, v in row[top].items() if k != "large_by_shape"}
            | {"large_by_shape": row[top]["large_by_shape"]}
            for label, row in rows.items()
        },
    }
    if args.sustained:
        kept_busy = sustained(sim, streams, args.tokens)
        report["sustained_tok_per_s"] = {
            label: {n: round(cell["tok_per_s"], 1) for n, cell in row.items()} for label, row in kept_busy.items()
        }
        report["sustained_ms_at_top_n"] = {label: row[top]["ms"] for label, row in kept_busy.items()}
    if args.check:
        report["forwards_vs_gpu_run"] = check_shapes(sim, args.tokens, Path(args.costs) / "catch_up_anatomy.json")
    print_report(report, streams)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_sim" + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    title = "Batch scaling at the H100's measured costs (simulated)"
    plot_scaling(report["tok_per_s"], streams, out / f"{stem}.png", "simulated tokens / s", title)
    print(f"saved {out / stem}.json and .png")


if __name__ == "__main__":
    main()
