"""gpu_check.py's probes of what the plan does not say: each graph's replay time as warmup
measured it (`replay_table`), M_S's replays at the k the engine does not capture and each
model's prompt prefill in graphs and eagerly (`probes`), how M_S's steps and a flight's M_L
forward slow each other on one GPU (`sharing`), and M_L's ragged forwards (`ragged_probe`).
gpu_costs.py reads them for benchmarks/gpu_sim.py.
"""

from __future__ import annotations

import statistics
import time

import torch

from backoff_core.engine.flight import HIGHEST_PRIORITY
from backoff_core.runners.graph_plan import GraphKey
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_ragged import RaggedKey


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
    keys = [  # M_L's ragged graphs (RaggedKey, captured at load under `auto`) are of no kind here
        key
        for key in graphs.ms
        if isinstance(key, GraphKey)
        and key.dense == dense
        and key.k == k
        and key.last_only
        and key.hidden_layer is None
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
    """M_L's ragged forwards (static_ragged.py; `auto` by default): one graph per token bucket captured
    (compiling FlexAttention) and timed (`replay_ms`, gpu_sim's price of them), beside the
    dense view of as many token slots at the shortest L (`dense_ms`: the estimate before).
    Timed on the capture's inputs, every token at the scratch column: one key block a query
    block; and laid out far over the free slots (`far`: the most key blocks a query block read
    there, and the replay's ms), the other end of the line `auto` prices a catch-up's ragged
    forward on by the key blocks its query blocks read (StaticRunner._ragged_ms).
    And a catch-up of six items of 2 to 37 tokens, ragged against the padded path (logits'
    relative error, bf16: StaticRunner.ragged_rel_err, warm-up's check). With KVSpec ragged
    "auto" (the default) the load captured them: `at_load`, and capture_s is ~0."""
    at_load = any(isinstance(k, RaggedKey) for k in runner.graphs.ms)
    graphs, seconds = runner.capture_ragged(progress=False)
    ms = {k.tokens: round(v, 3) for k, v in runner.graphs.ms.items() if isinstance(k, RaggedKey)}
    views = {k: v for k, v in runner.graphs.ms.items() if isinstance(k, GraphKey) and k.dense and k.last_only}
    shortest = min(k.length for k in views)
    dense = {}
    for tokens in ms:
        fits = [(k.token_slots, v) for k, v in views.items() if k.length == shortest and k.token_slots >= tokens]
        if fits:
            dense[tokens] = round(min(fits)[1], 3)
    return {
        "graphs": graphs,
        "at_load": at_load,
        "capture_s": round(seconds, 1),
        "replay_ms": ms,
        "far": {k.tokens: {"blocks": read, "ms": round(v, 3)} for k, (read, v) in runner.graphs.far.items()},
        "dense_ms": dense,
        "rel_err": runner.ragged_rel_err(prompt_ids),
    }
