"""The benchmark pair on the GPU at gpu_bench.sh's defaults, checked against the plan.

    python benchmarks/gpu_check.py --small /tmp/pair/small --large /tmp/pair/large --out DIR

Loads the pair (bf16), builds each runner as the engine does (factory.make_runner: static
KV slots, graphs captured now) and measures what benchmarks/gpu_plan.py predicts: graphs,
capture seconds, KV bytes and the memory the capture added (pool + static buffers). Then
checks the real shapes: M_L's logits after a prompt catch-up (in blocks) against HF's own bf16
forward, and a few generations per routing with no forward run eagerly. Last, where the
time of one step goes: a captured step's GPU time alone (CUDA events around the replay) and
its kernel count, against the whole runner.extend (plan, upload, replay, float copy), for
M_S as the factory builds it (fused projections and norms), without the fused projections,
and with HF's own modules throughout, and for M_L. Also saves every graph's replay time as
warmup measured it (`replay_ms`: what static_layout.choose weighs, and the cost table of
benchmarks/gpu_sim.py). And what the engine's graphs do not hold but gpu_sim prices
(`probes`): M_S's replays at k 4, 8 and 16 (a prompt's prefill in fewer rows), and each model's
prompt prefill run eagerly against the same prefill in graphs (what a forward no graph holds
costs). And how M_S's steps and an M_L forward slow each other side by side on one GPU
(`sharing`: catch-ups in flight; gpu_sim --what-if shared), the two streams of one priority
and with either first (`first`: flight.ThreadLauncher.first). Last, M_L's ragged forwards
(`ragged`: static_ragged.py, each token bucket's replay time and the logits against the
padded path; gpu_sim --what-if ragged prices them so). Writes DIR/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from backoff_core.engine.engine import BackoffEngine
from backoff_core.engine.flight import HIGHEST_PRIORITY
from backoff_core.models.loading import LoadSpec, load_chain
from backoff_core.models.prompts import encode_prompt
from backoff_core.runners.factory import make_runner
from backoff_core.runners.graph_plan import GraphKey
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_ragged import RaggedKey
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams, Verification
from benchmarks.gpu_plan import plan

GIB = 2**30
ROUTINGS = {
    "always-small": RoutingParams(router="always-small"),
    "always-large": RoutingParams(router="always-large"),
    "random b=0.9": RoutingParams(router="random", rate=0.9),
    "draft K=4": RoutingParams(router="draft", draft_tokens=4, verification=Verification.EXACT),
}


def build(chain, kv: KVSpec) -> tuple[list, dict]:
    runners, measured = [], {}
    for i, (model, name) in enumerate(zip(chain.models, ("small", "large"))):
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        start = time.perf_counter()
        runner = make_runner(model, name, kv, small=i == 0)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        added = torch.cuda.memory_reserved() - before
        kv_bytes, fused = runner.kv.nbytes(), runner._forward.fused_nbytes()
        measured[name] = {
            "graphs": len(runner.graphs),
            "build_and_capture_s": round(seconds, 2),
            "kv_gib": round(kv_bytes / GIB, 3),
            "weights_gib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / GIB, 3),
            "pool_gib": round((added - kv_bytes - fused) / GIB, 3),
            "fused_gib": round(fused / GIB, 3),  # M_S's fused projections (static_forward.py)
        }
        runners.append(runner)
    return runners, measured


@torch.inference_mode()
def logits_error(chain, runner, prompt_ids) -> float:
    """||ours - HF|| / ||HF|| of M_L's logits at the prompt's positions (both bf16)."""
    runner.open("check")
    got = runner.extend([("check", prompt_ids)])[0].logits
    runner.close("check")
    ref = chain.models[-1](torch.tensor([prompt_ids], device="cuda")).logits[0].float()
    return float((got - ref).norm() / ref.norm())


def median_ms(fn, repeats: int = 50) -> float:
    """Median wall time of fn() with the device synchronised around it (where it is CUDA)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


@torch.inference_mode()
def step_anatomy(run: StaticRunner, rows: int, prompt_ids: list[int]) -> dict:
    """One decode step of `rows` sessions holding the prompt: the whole extend, the graph's
    replay alone (events), and the kernels one replay launches."""
    ids = [f"anatomy{i}" for i in range(rows)]
    for r in ids:
        run.open(r)
        run.extend([(r, prompt_ids)], last_only=True)
    length = len(prompt_ids)

    def step():
        run.extend([(r, [5]) for r in ids], last_only=True)
        for r in ids:
            run.crop(r, length)

    extend_ms = median_ms(step)
    step()  # leaves the step's inputs in the static buffers
    key = GraphKey(True, rows, 1, run.length_buckets[0], True, None)
    graph = run.graphs._graphs[key]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay = []
    for _ in range(50):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        replay.append(start.elapsed_time(end))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for r in ids:
        run.close(r)
    return {
        "rows": rows,
        "extend_ms": round(extend_ms, 3),
        "graph_replay_ms": round(sorted(replay)[25], 3),
        "kernels_per_replay": len(kernels),
    }


# M_S's forward as factory.make_runner builds it (fused projections and norms), then without
# the fused projections, then with HF's own modules throughout: the kernels each saves
PROBES = {
    "M_S fused projections and norms": (True, True),
    "M_S fused norms": (False, True),
    "M_S HF modules": (False, False),
}


def anatomy(chain, runners, prompt_ids) -> dict:
    out = {}
    for label, (projections, norms) in PROBES.items():
        probe = StaticRunner(
            chain.models[0], "probe", kv_budget_tokens=64 * 1024, max_len=1024, fuse_projections=projections
        )
        probe._forward.fused_norms = norms
        probe.warmup(last_only=(True,), ks=(1,), progress=False)
        out[label] = [step_anatomy(probe, rows, prompt_ids) for rows in (1, 64)]
        del probe
        torch.cuda.empty_cache()
    out["M_L"] = [step_anatomy(runners[-1], rows, prompt_ids) for rows in (1, 16)]
    return out


PROBE_KS = (1, 2, 4, 8, 16)  # M_S's k buckets in the probe (the engine captures 1 and 2)


@torch.inference_mode()
def prefill_ms(runner: StaticRunner, prompt_ids: list[int], repeats: int = 10) -> dict:
    """One prompt's prefill through `runner`: as the engine runs it (graphs, in blocks where
    a layout fits) and eagerly (the same runner with its graphs set aside), median ms."""

    def prefill():
        runner.open("probe")
        runner.extend([("probe", prompt_ids)], last_only=True)
        runner.close("probe")

    out = {"tokens": len(prompt_ids), "graphs": round(median_ms(prefill, repeats), 3)}
    graphs, runner.graphs = runner.graphs, None
    try:
        prefill()  # the eager kernels' first run (their selection, the allocator) left out
        out["eager"] = round(median_ms(prefill, repeats), 3)
    finally:
        runner.graphs = graphs
    return out


def probes(small_model, runners: list[StaticRunner], prompt_ids: list[int], graphs=None) -> dict:
    """What gpu_sim prices that the engine's graphs do not hold: `small_k`, the replay time of
    every M_S graph at k > 2 (a probe runner built as factory.make_runner builds M_S, captured
    at k up to 16); `prefill_ms`, each model's prompt prefill in graphs and eagerly.
    graphs(runner): the probe's CudaGraphs (tests: EagerGraphs on the CPU); None: its own."""
    probe = StaticRunner(small_model, "probe", kv_budget_tokens=64 * 1024, max_len=1024, fuse_projections=True)
    if graphs is not None:
        probe.graphs = graphs(probe)
    probe.warmup(last_only=(True,), ks=PROBE_KS, progress=False)
    small_k = [e for e in replay_table(probe) if e["k"] > 2]
    del probe
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "small_k": small_k,
        "prefill_ms": {name: prefill_ms(r, prompt_ids) for name, r in zip(("small", "large"), runners)},
    }


def commonest(graphs, dense: bool, k: int) -> GraphKey:
    """The timed graph of a kind (last logits, no hidden layer) with the most rows, at the
    shortest key length: M_S's step of a full batch (dense, k = 1), or M_L's catch-up of 64
    rows of 8 in blocks (gathered, k = 8; the commonest at 64 streams, catch_up_anatomy)."""
    keys = [
        key for key in graphs.ms if key.dense == dense and key.k == k and key.last_only and key.hidden_layer is None
    ]
    if not keys:
        raise ValueError(f"no {'dense' if dense else 'gathered'} graph of k={k} was captured and timed")
    return max(keys, key=lambda key: (key.rows, -key.length))


@torch.inference_mode()
def sharing(runners: list[StaticRunner], repeats: int = 5) -> dict:
    """How M_S's steps and a flight's M_L forward slow each other on one GPU (gpu_sim
    --what-if shared reads it; engine `overlap_catch_ups`). M_S's step graph of a full batch
    and M_L's catch-up graph of 64 rows x 8 (`commonest`), on harmless inputs, each timed
    alone, then side by side as a flight runs: M_L's replayed on a side stream while M_S's
    are replayed back to back on the loop's, enough of them to outlast it. small_slowdown: M_S's
    replay beside M_L's over alone (the replays that ended while M_L's ran; the first, if none
    did); large_slowdown: M_L's beside M_S's over alone. Medians of `repeats`. At the top
    level the two streams of one priority, as the engine runs flights by default; under
    `first`, "loop" and "flight": that side's stream of the highest priority
    (flight.ThreadLauncher.first)."""
    small, large = runners[0].graphs, runners[-1].graphs
    s_key, l_key = commonest(small, True, 1), commonest(large, False, 8)
    s_alone, l_alone = small.replay_ms(s_key, repeats), large.replay_ms(l_key, repeats)
    graphs = small._graphs[s_key], large._graphs[l_key]
    n = int(4 * l_alone / s_alone) + 4  # M_S's replays outlast M_L's even if M_L is slowed 3x
    low, high = torch.cuda.Stream(), torch.cuda.Stream(priority=HIGHEST_PRIORITY)
    shapes = {
        "small": {"rows": s_key.rows, "k": s_key.k, "L": s_key.length, "dense": s_key.dense},
        "large": {"rows": l_key.rows, "k": l_key.k, "L": l_key.length, "dense": l_key.dense},
        "small_ms": round(s_alone, 3),
        "large_ms": round(l_alone, 3),
    }
    alone = s_alone, l_alone
    equal = _side_by_side(graphs, n, low, torch.cuda.current_stream(), repeats, alone)
    first = {
        "loop": _side_by_side(graphs, n, low, high, repeats, alone),
        "flight": _side_by_side(graphs, n, high, torch.cuda.current_stream(), repeats, alone),
    }
    return shapes | equal | {"first": first}


def _side_by_side(graphs, n: int, side, loop, repeats: int, alone: tuple[float, float]) -> dict:
    """M_L's graph replayed once on `side` while M_S's is replayed n times on `loop`."""
    s_graph, l_graph = graphs
    beside_s, beside_l, counts = [], [], []
    for _ in range(repeats):
        l_start, l_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        torch.cuda.synchronize()
        with torch.cuda.stream(side):  # the flight
            l_start.record()
            l_graph.replay()
            l_end.record()
        with torch.cuda.stream(loop):  # the loop's steps, back to back
            marks[0].record()
            for mark in marks[1:]:
                s_graph.replay()
                mark.record()
        torch.cuda.synchronize()
        l_ms = l_start.elapsed_time(l_end)
        steps = [(a.elapsed_time(b), l_start.elapsed_time(b)) for a, b in zip(marks, marks[1:])]
        within = [ms for ms, ended in steps if ended <= l_ms] or [steps[0][0]]
        beside_s.append(statistics.median_high(within))
        beside_l.append(l_ms)
        counts.append(len(within))
    median = statistics.median_high
    return {
        "small_ms_beside": round(median(beside_s), 3),
        "large_ms_beside": round(median(beside_l), 3),
        "small_steps_within": median(counts),
        "small_slowdown": round(median(beside_s) / alone[0], 3),
        "large_slowdown": round(median(beside_l) / alone[1], 3),
    }


def replay_table(runner: StaticRunner) -> list[dict]:
    """Every captured graph's replay time (ms), as warmup measured it."""
    padded = {k: ms for k, ms in runner.graphs.ms.items() if isinstance(k, GraphKey)}
    return [
        {"dense": k.dense, "rows": k.rows, "k": k.k, "L": k.length, "last_only": k.last_only, "layer": k.hidden_layer}
        | {"ms": round(ms, 3)}
        for k, ms in sorted(padded.items(), key=lambda kv: (kv[0].dense, kv[0].rows, kv[0].k, kv[0].length))
    ]


@torch.inference_mode()
def ragged_probe(runner: StaticRunner, prompt_ids: list[int]) -> dict:
    """M_L's ragged forwards (static_ragged.py, opt-in): one graph per token bucket captured
    (compiling FlexAttention) and timed (`replay_ms`, gpu_sim's price of them), beside the
    dense view of as many token slots at the shortest L (`dense_ms`: the estimate before).
    Timed on the capture's inputs, every token at the scratch column: one key block each, as
    the batch benchmark's contexts of under 128 positions read; longer contexts read more.
    And a catch-up of six items of 2 to 37 tokens, ragged against the padded path (logits'
    relative error, bf16)."""
    graphs, seconds = runner.capture_ragged(progress=False)
    ms = {k.tokens: round(v, 3) for k, v in runner.graphs.ms.items() if isinstance(k, RaggedKey)}
    views = {k: v for k, v in runner.graphs.ms.items() if isinstance(k, GraphKey) and k.dense and k.last_only}
    shortest = min(k.length for k in views)
    dense = {}
    for tokens in ms:
        fits = [(k.token_slots, v) for k, v in views.items() if k.length == shortest and k.token_slots >= tokens]
        if fits:
            dense[tokens] = round(min(fits)[1], 3)
    logits = {}
    for ragged in (False, True):
        runner.ragged = ragged
        sids = [f"ragged-probe-{ragged}-{i}" for i in range(6)]
        for request_id in sids:
            runner.open(request_id)
        runner.extend([(r, list(prompt_ids)) for r in sids], last_only=True)
        items = [(r, list(prompt_ids[: 2 + 7 * i])) for i, r in enumerate(sids)]
        logits[ragged] = torch.stack([e.last for e in runner.extend(items, last_only=True)])
        for request_id in sids:
            runner.close(request_id)
    runner.ragged = False
    err = float((logits[True] - logits[False]).norm() / logits[False].norm())
    return {"graphs": graphs, "capture_s": round(seconds, 1), "replay_ms": ms, "dense_ms": dense, "rel_err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", required=True)
    ap.add_argument("--large", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-budget", type=int, default=65536)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/gpu")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()

    start = time.perf_counter()
    chain = load_chain(args.small, args.large, (), LoadSpec(args.device, args.dtype))
    load_s = time.perf_counter() - start
    runners, measured = build(chain, KVSpec(args.kv_budget, args.max_len))
    engine = BackoffEngine(
        runners, chain.tokenizer, context_window=chain.context_window, hidden_size=chain.models[0].config.hidden_size
    )
    prompt = encode_prompt(chain.tokenizer, "Write a short paragraph about the history of Python.", chat=True)
    error = logits_error(chain, runners[-1], prompt)
    eager_before = [r.eager_passes for r in runners]
    runs = {}
    for label, routing in ROUTINGS.items():
        reqs = [
            GenerationRequest(tuple(prompt), SamplingParams(max_tokens=args.tokens, seed=i, ignore_eos=True), routing)
            for i in range(4)
        ]
        torch.cuda.synchronize()
        t = time.perf_counter()
        results = engine.generate_many(reqs)
        torch.cuda.synchronize()
        runs[label] = {
            "tokens": sum(len(r.token_ids) for r in results),
            "seconds": round(time.perf_counter() - t, 3),
            "from_small": sum(r.sources.count(0) for r in results),
        }
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_s": round(load_s, 1),
        "plan": plan(args.kv_budget, args.max_len)["models"],
        "measured": measured,
        "memory_reserved_gib": round(torch.cuda.memory_reserved() / GIB, 3),
        "large_logits_rel_err_vs_hf_bf16": error,
        "eager_passes_after_load": [r.eager_passes - e for r, e in zip(runners, eager_before)],
        "forward_passes": [r.forward_passes for r in runners],
        "generate_many_4x": runs,
        "replay_ms": {name: replay_table(r) for name, r in zip(("small", "large"), runners)},
    }
    try:
        report["step_anatomy"] = anatomy(chain, runners, prompt)
    except Exception as exc:  # noqa: BLE001 - a diagnostic: keep the checks above either way
        report["step_anatomy"] = f"failed: {exc!r}"
    try:
        report["sharing"] = sharing(runners)
    except Exception as exc:  # noqa: BLE001 - a diagnostic, as above
        report["sharing"] = f"failed: {exc!r}"
    try:
        report["probes"] = probes(chain.models[0], runners, prompt)
    except Exception as exc:  # noqa: BLE001 - a diagnostic, as above
        report["probes"] = f"failed: {exc!r}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")  # before the first ragged compile
    try:
        report["ragged"] = ragged_probe(runners[-1], prompt)
    except Exception as exc:  # noqa: BLE001 - a diagnostic, as above
        report["ragged"] = f"failed: {exc!r}"
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
