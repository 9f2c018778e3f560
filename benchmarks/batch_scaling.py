"""Aggregate throughput of many concurrent requests in one engine (batched steps), per routing.

    python benchmarks/batch_scaling.py                      # the embedded default pair, CPU
    python benchmarks/batch_scaling.py --small models/small --large models/large \
        --device cuda --dtype bfloat16 --kv-budget 262144 --max-len 1024 --tag h100
    python benchmarks/batch_scaling.py --interleave 1000 --streams 16,64   # batched vs at once, in turn

n requests of --tokens tokens each run together through `engine.generate_many` (one M_S
forward per step for all of them, one catch-up forward per level); tok/s counts generated
tokens over the wall time after admission. Every figure is a median over repeats, all in
one run. Saves benchmarks/results[/gpu]/batch_scaling[-TAG].{json,png} as
{"tok_per_s": {"<routing label>": {"<n>": value}}, "catch_up_forwards_per_100_tokens": ...,
"itl_median_ms": ..., "itl_p99_ms": ..., "errors": {"<routing label>": "why it was not measured"},
...} (the inter-token latencies of every request; a row that raises is reported in errors and
the others measured).
Batched catch-ups (docs/batched-catch-ups.md): "random b=0.9" runs the engine's default
(catch_up_wait_ms, --catch-up-wait-ms), "random b=0.9, catch-ups at once" runs each in the step
that routes it (0), and "random b=0.9, waits up to 1 s" lets the half-of-live rule alone end
the waits. Catch-ups in flight (engine `overlap_catch_ups`, flight.py): "random b=0.9, in
flight" runs each catch-up beside M_S's next steps (no hold), "in flight, loop first" and
"flight first" with the GPU scheduling M_S's or M_L's kernels first (CUDA stream priority,
ThreadLauncher.first), "held and in flight" after the default hold. Ragged catch-ups
(static_ragged.py): every row runs the default, KVSpec ragged "auto" (on CUDA with graphs, a
catch-up ragged where its replays were timed faster than its padded layout's; padded on the
CPU), but ", padded" rows (M_L's catch-ups padded alone: "off") and ", ragged" rows (ragged
wherever they apply: "on"). The first row that may run ragged captures M_L's ragged graphs if
the load did not, and compares a ragged catch-up's logits with the padded path's
("ragged_rel_err": a row that is fast and wrong is not a win; above RAGGED_TOLERANCE it is
flagged). ", launched ahead" rows queue each M_S step before the last one's tokens are read
back (engine `launch_ahead`, ahead.py: M_S on static KV; elsewhere the row reports the error).
All in the same run, for the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the packages importable
from backoff_core.engine.engine import CATCH_UP_WAIT_MS, BackoffEngine  # noqa: E402
from backoff_core.models.loading import LoadSpec, load_chain  # noqa: E402
from backoff_core.models.prompts import encode_prompt  # noqa: E402
from backoff_core.runners.static import StaticRunner  # noqa: E402
from backoff_core.runners.static_ragged import RAGGED_TOLERANCE, RaggedKey  # noqa: E402
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams  # noqa: E402
from benchmarks.batch_scaling_report import plot_report, print_report, results  # noqa: E402

PROMPT = "Write a short paragraph about the history of the Python programming language."
B09 = RoutingParams(router="random", rate=0.9)
# how a row's catch-ups fly (overlap_catch_ups) -> flight.ThreadLauncher.first: whose kernels
# the GPU schedules first, by stream priority (None: neither, the engine's default)
FLIGHTS = {"one priority": None, "loop first": "loop", "flight first": "flight"}
# label -> (routing, the engine's catch_up_wait_ms: None keeps --catch-up-wait-ms, a key of
# FLIGHTS or None: synchronous). --rows runs some, in its order (the batch stage's: the goal's
# row, then the levers never run on a GPU, then the bounds earlier runs measured). A row that
# raises costs no other, and the results are saved after every row (a stage cut short keeps
# what it measured).
ROUTINGS = {
    "always-large": (RoutingParams(router="always-large"), None, None),
    "random b=0.9": (B09, None, None),
    "random b=0.9, launched ahead": (B09, None, None),
    "random b=0.9, padded": (B09, None, None),
    "always-small": (RoutingParams(router="always-small"), None, None),
    "always-small, launched ahead": (RoutingParams(router="always-small"), None, None),
    "random b=0.9, in flight": (B09, 0.0, "one priority"),
    "random b=0.9, in flight, loop first": (B09, 0.0, "loop first"),
    "random b=0.9, in flight, flight first": (B09, 0.0, "flight first"),
    "random b=0.9, ragged": (B09, None, None),
    "random b=0.9, ragged, in flight": (B09, 0.0, "one priority"),
    "random b=0.9, catch-ups at once": (B09, 0.0, None),
    "random b=0.9, waits up to 1 s": (B09, 1000.0, None),
    "random b=0.9, held and in flight": (B09, None, "one priority"),
}


def launched_ahead(label: str) -> bool:
    """Whether a row runs M_S's steps launched ahead (engine launch_ahead): ", launched ahead"."""
    return ", launched ahead" in label


def set_overlaps(engine, flights: bool, ahead: bool) -> None:
    """The engine's overlap_catch_ups and launch_ahead, which do not go together: launching
    ahead off first, so that either may be turned on."""
    engine.launch_ahead = False
    engine.overlap_catch_ups = flights
    engine.launch_ahead = ahead


def ragged_mode(label: str) -> str:
    """A row's KVSpec.ragged for M_L's catch-ups: "on" (", ragged"), "off" (", padded"), else the default "auto"."""
    return "on" if ", ragged" in label else "off" if ", padded" in label else "auto"


def throughput(
    engine, prompt_ids, n, tokens, routing, repeats, wait_ms: float, flight: str | None = None, ahead: bool = False
) -> dict[str, float]:
    """n requests generated together, `repeats` times, catch-ups waiting up to `wait_ms` to
    be batched (and, with a flight, in flight beside M_S's steps; with ahead, M_S's steps
    launched before their tokens are read back): the median tok/s (admission
    excluded); catch-up forwards per 100 tokens (a forward shared by m requests is in each
    one's record, CatchUp.batch_size = m: 1/m each); the realised routed share (tokens a larger
    model gave);
    the inter-token latency's median and p99 over every request's tokens (ms)."""
    engine.catch_up_wait_ms = wait_ms
    set_overlaps(engine, flight is not None, ahead)
    if flight is not None:
        engine.launcher.first = FLIGHTS[flight]
    rates, forwards, generated, gaps, routed = [], 0.0, 0, [], 0
    for rep in range(repeats):
        reqs = [
            GenerationRequest(
                tuple(prompt_ids), SamplingParams(max_tokens=tokens, seed=rep * 1000 + i, ignore_eos=True), routing
            )
            for i in range(n)
        ]
        rids = [engine.submit(r) for r in reqs]
        last: dict[str, float] = {}  # request id -> when its last token arrived
        _sync()
        start = time.perf_counter()
        while engine.has_work():
            events = engine.step()
            now = time.perf_counter()
            for request_id in events:
                if request_id in last:
                    gaps.append(now - last[request_id])
                last[request_id] = now
        _sync()
        seconds = time.perf_counter() - start
        results = [engine.finish(request_id) for request_id in rids]
        done = sum(len(r.token_ids) for r in results)
        rates.append(done / seconds)
        forwards += sum(1 / c.batch_size for r in results for c in r.catch_ups)
        routed += sum(s > 0 for r in results for s in r.sources)
        generated += done
    return {
        "tok_per_s": statistics.median(rates),
        "forwards_per_100_tokens": 100 * forwards / generated,
        "routed_share": routed / generated,  # the realised share of tokens a larger model gave
        "itl_median_ms": 1e3 * statistics.median(gaps) if gaps else 0.0,
        "itl_p99_ms": 1e3 * statistics.quantiles(gaps, n=100, method="inclusive")[98] if len(gaps) > 1 else 0.0,
    }


def measure(
    engine,
    prompt_ids,
    streams: list[int],
    tokens: int,
    repeats: int,
    waits: dict[str, float],
    rows: list[str] | None = None,
    after_row: Callable[[dict, dict], None] | None = None,
    checks: dict | None = None,
    repeats_one: int | None = None,
    until: float | None = None,
) -> tuple[dict[str, dict[str, dict]], dict[str, str]]:
    """The rows of ROUTINGS (`rows`, in its order; default every one) at every n (each row warmed up first:
    allocator growth, lazy initialisation): ({label: {n: throughput's figures}}, {label: the
    error of a row that raised}), handed to `after_row` after each. A row that raises is
    reported, not measured, and its requests cancelled, so one failing row (a first run on
    new hardware) does not cost the others; after a failure that leaves the engine unclean,
    the rows left are skipped, with that reason. The first ragged row first puts the ragged
    catch-up's logits against the padded path's in `checks` ("ragged_rel_err"). repeats_one:
    the repeats of a cell at one stream (default `repeats`); until: a time.perf_counter() past
    which a row is not started (in errors: "skipped: past the deadline")."""
    runs, errors = {}, {}
    checks = {} if checks is None else checks
    picked = {label: ROUTINGS[label] for label in rows} if rows is not None else ROUTINGS
    for label, (routing, _, flight) in tqdm(picked.items(), desc="routings"):
        if until is not None and time.perf_counter() > until:
            errors[label] = "skipped: past the deadline"
            continue
        if errors and engine.has_work():
            errors[label] = f"skipped: the engine still had work after {next(iter(errors))!r} failed"
            continue
        try:
            _ragged(engine, ragged_mode(label), prompt_ids, checks)
            # M_L's graphs the row ran with: a padded row adds the k = 16 kind that ragged's
            # displaced, and the rows after it keep it (the report says so, row by row)
            checks.setdefault("large_graphs", {})[label] = _large_graphs(engine)
            ahead = launched_ahead(label)
            throughput(engine, prompt_ids, 2, 4, routing, 1, waits[label], flight, ahead)
            runs[label] = {
                str(n): throughput(
                    engine,
                    prompt_ids,
                    n,
                    tokens,
                    routing,
                    cell_repeats(n, repeats, repeats_one),
                    waits[label],
                    flight,
                    ahead,
                )
                for n in tqdm(streams, desc=label, leave=False)
            }
        except Exception as exc:  # noqa: BLE001 - reported in the results, the other rows go on
            errors[label] = f"{type(exc).__name__}: {exc}"
            tqdm.write(f"{label}: FAILED, {errors[label]}")
            _cancel_all(engine)
        if after_row is not None:
            after_row(runs, errors)
    _ragged(engine, "auto")
    engine.launch_ahead = False
    return runs, errors


def cell_repeats(n: int, repeats: int, repeats_one: int | None) -> int:
    """A cell's repeats: one stream's tok/s moves most run to run (a 64-token request is ~0.1 s
    on a GPU), so its cells repeat repeats_one times (16 by default in the stage)."""
    return repeats_one if n == 1 and repeats_one is not None else repeats


def _ragged(engine, mode: str, prompt_ids=(), checks: dict | None = None) -> None:
    """M_L's catch-ups as KVSpec.ragged `mode` has them: "off" padded (over the padded plan an
    "off" runner captures: the graphs the ragged ones displaced are added); "auto" ragged where its
    captured graphs were timed faster (padded without graphs, or where the load's warm-up
    turned them off); "on" ragged wherever they apply, its graphs captured if the load did not.
    The first time they may run ragged (with `checks`), a ragged catch-up's logits are put
    against the padded path's."""
    large = engine.models[-1]
    if not isinstance(large, StaticRunner):
        if mode == "on":
            raise ValueError("ragged catch-ups need static KV storage (--kv-budget)")
        return
    captured = large.graphs is not None and any(isinstance(key, RaggedKey) for key in large.graphs.ms)
    if mode == "off" or (mode == "auto" and not captured):
        large.ragged = False
        if mode == "off" and (seconds := large.capture_padded()):  # the graphs ragged's had displaced
            tqdm.write(f"{large.name}: the padded plan's k = 16 graphs captured and timed in {seconds:.1f} s")
        return
    if large.graphs is not None and not captured:
        graphs, seconds = large.capture_ragged()
        tqdm.write(f"{large.name}: {graphs} ragged graphs captured and timed in {seconds:.1f} s")
    if checks is not None and "ragged_rel_err" not in checks:
        checks["ragged_rel_err"] = err = large.ragged_rel_err(list(prompt_ids))
        flag = f" (over {RAGGED_TOLERANCE}: suspect)" if not err <= RAGGED_TOLERANCE else ""
        tqdm.write(f"{large.name}: ragged catch-up logits vs padded, relative error {err:.4f}{flag}")
    large.ragged, large.ragged_if_faster = True, mode == "auto"


def _large_graphs(engine) -> dict | None:
    """M_L's captured graphs now: padded and ragged counts (None without graphs)."""
    large = engine.models[-1]
    if not isinstance(large, StaticRunner) or large.graphs is None:
        return None
    ragged = sum(isinstance(key, RaggedKey) for key in large.graphs.ms)
    return {"padded": len(large.graphs.ms) - ragged, "ragged": ragged}


def _cancel_all(engine) -> None:
    """Cancel whatever a failed row left live; a catch-up still in flight is landed (its
    error, if it has one, is dropped: it was reported)."""
    for request_id in engine.live_ids():
        engine.cancel(request_id)
    if engine.flights is not None and engine.flights.busy:
        try:
            engine.flights.land(wait=True)
        except Exception:  # noqa: BLE001 - the row's error is already reported
            pass


def _out_dir(args) -> Path:
    out = Path(args.out or ("benchmarks/results/gpu" if args.device.startswith("cuda") else "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small")
    ap.add_argument("--large")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", default="1,4,16,64", help="comma-separated concurrency levels n")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repeats-one", type=int, default=16, help="repeats of a cell at one stream (median)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from the start: later rows skipped")
    ap.add_argument("--kv-budget", type=int, default=None, help="static KV storage of this many tokens per model")
    ap.add_argument("--max-len", type=int, default=1024, help="positions per static KV slot")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument(
        "--catch-up-wait-ms", type=float, default=CATCH_UP_WAIT_MS, help="the engine's catch_up_wait_ms (0: at once)"
    )
    ap.add_argument(
        "--interleave",
        type=float,
        metavar="MS",
        help="instead: b=0.9 with catch_up_wait_ms = MS against 0, in turn, --repeats rounds of one "
        "repeat each per n (the machine's drift hits both alike); saves batch_scaling_interleaved[-TAG].json",
    )
    ap.add_argument("--rows", nargs="+", metavar="LABEL", help="labels of ROUTINGS to run (default: every row)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=None, help="default: benchmarks/results (benchmarks/results/gpu on cuda)")
    args = ap.parse_args()
    rows = args.rows
    if rows is not None and (unknown := [label for label in rows if label not in ROUTINGS]):
        ap.error(f"unknown rows {unknown}; the rows are {list(ROUTINGS)}")
    transformers.logging.set_verbosity_error()

    t0 = time.perf_counter()
    chain = load_chain(args.small, args.large, (), LoadSpec(args.device, args.dtype))
    kv = KVSpec(args.kv_budget, args.max_len, not args.no_cuda_graphs) if args.kv_budget else None
    start = time.perf_counter()
    engine = BackoffEngine.from_chain(chain, kv=kv)
    load_s = time.perf_counter() - start
    prompt_ids = encode_prompt(chain.tokenizer, PROMPT, chat=bool(chain.tokenizer.chat_template))
    streams = [int(s) for s in args.streams.split(",")]
    if args.interleave is not None:
        return _interleaved(engine, prompt_ids, streams, args)
    waits = {label: args.catch_up_wait_ms if wait is None else wait for label, (_, wait, _) in ROUTINGS.items()}
    out = _out_dir(args)
    stem = "batch_scaling" + (f"-{args.tag}" if args.tag else "")
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None  # before any row can break CUDA

    checks: dict = {"large_graphs_at_load": _large_graphs(engine)}  # ragged 0 under auto: its warm-up turned it off

    def save(runs: dict, errors: dict) -> dict:
        report = results(args, kv, load_s, waits, streams, runs, errors, gpu) | checks
        (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
        return report

    until = None if args.deadline is None else t0 + args.deadline
    runs, errors = measure(
        engine, prompt_ids, streams, args.tokens, args.repeats, waits, rows, save, checks, args.repeats_one, until
    )
    report = save(runs, errors)
    print_report(report, streams)
    plot_report(report, streams, out / f"{stem}.png")
    print(f"saved {out / stem}.json and .png")


def _interleaved(engine, prompt_ids, streams: list[int], args) -> None:
    """b=0.9 with catch-ups waiting up to args.interleave ms against at once, in turn."""
    routing = ROUTINGS["random b=0.9"][0]
    waits = (args.interleave, 0.0)
    throughput(engine, prompt_ids, 2, 4, routing, 1, waits[0])  # warm-up
    rounds: dict[str, list[dict]] = {str(n): [] for n in streams}
    for _ in tqdm(range(args.repeats), desc="rounds"):
        for n in streams:
            pair = [throughput(engine, prompt_ids, n, args.tokens, routing, 1, w) for w in waits]
            rounds[str(n)].append({"waiting": pair[0], "at_once": pair[1]})
    ratios = {
        n: statistics.median(r["waiting"]["tok_per_s"] / r["at_once"]["tok_per_s"] for r in rs)
        for n, rs in rounds.items()
    }
    print(f"\nb=0.9, catch-ups waiting up to {args.interleave:g} ms vs at once (tok/s per round; median ratio)")
    for n, rs in rounds.items():
        cells = ", ".join(f"{r['waiting']['tok_per_s']:.0f}/{r['at_once']['tok_per_s']:.0f}" for r in rs)
        print(f"n={n:>3s}: {cells}   x{ratios[n]:.2f}")
    out = _out_dir(args)
    path = out / ("batch_scaling_interleaved" + (f"-{args.tag}" if args.tag else "") + ".json")
    report = {"device": args.device, "dtype": args.dtype, "tokens": args.tokens, "catch_up_wait_ms": args.interleave}
    path.write_text(json.dumps({**report, "ratio_median": ratios, "rounds": rounds}, indent=2))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
