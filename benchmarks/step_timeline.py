"""Where a batch's wall time goes on a GPU: the forwards' device time, the host's waits on the
device, and the host's own work, per routing, for n streams together (batch_scaling.py's run).

    python benchmarks/step_timeline.py --small S --large L --device cuda --dtype bfloat16 \
        --kv-budget 65536 --max-len 1024 --out benchmarks/results/gpu     # scripts/gpu_bench.sh timeline

The simulator (gpu_sim.py) prices every forward at its replay time and each step at a host
time; with the host priced from CPU figures, the fourth H100 run measured 64 streams at b=0.9 at 0.79
of its prediction (always-large 0.83): what the replays do not time is what this measures.
Each row runs `--repeats` times plain after a warm-up, then twice more, the same requests
each time:
  plain     tok/s as batch_scaling.py measures it (the median; nothing added);
  events    a CUDA event pair around every graph replay and eager forward of both models
            and every draw (sampling's kernels over the vocabulary, outside the graphs), read
            after the run (no sync added), and the host's time blocked in the step loop's
            device-to-host reads (host.Read.values, the one way to the host: the wait);
  profile   cProfile over the step loop (admission left out): the host functions that
            take the time (the reads' blocking shows under `tolist`).
Admission (the n submits: the prompts' prefill, a prefix cache's loads) is outside the clock
as in batch_scaling.py; its wall is saved apart (`admission_ms`, the plain runs' median).
Then `wall = device time (forwards and draws) + device idle`: the idle is the host's work
that the device waits for (and the few small ops outside both). gpu_costs.fit_host fits the
simulator's host costs to the plain runs. Rows: the goal's (random b=0.9, catch-ups held as
the engine's default, the waits ending where `max_share` of the live requests would wait: a
half, the default, and a third; and the default with M_S's steps launched ahead, where the
idle should shrink: engine launch_ahead), always-large and always-small. On the CPU (a dry run:
image_check.sh) the forwards run synchronously and the clock stands in for the events.
Saves step_timeline.json (and prints the table).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import types
from pathlib import Path
from typing import NamedTuple

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from backoff_core.engine import catchup, host, propose  # noqa: E402
from backoff_core.engine.engine import BackoffEngine  # noqa: E402
from backoff_core.models.loading import LoadSpec, load_chain  # noqa: E402
from backoff_core.models.prompts import encode_prompt  # noqa: E402
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams  # noqa: E402
from benchmarks.batch_scaling import B09, PROMPT, _sync, launched_ahead  # noqa: E402

# label -> (routing, the hold's max_share: None keeps the engine's); ", launched ahead": the
# engine's launch_ahead (ahead.py)
ROWS = {
    "random b=0.9": (B09, None),  # the default: a half
    "random b=0.9, launched ahead": (B09, None),
    "random b=0.9, max_share 1/3": (B09, 1 / 3),
    "always-large": (RoutingParams(router="always-large"), None),
    "always-small": (RoutingParams(router="always-small"), None),
}
DRAWERS = (catchup, propose)  # the step's modules that draw tokens (sampling.draw)


class Run(NamedTuple):
    seconds: float  # the step loop's wall, admission excluded (batch_scaling's clock)
    tokens: int
    steps: int
    admission_s: float  # submitting the n requests: their prefill (and prefix-cache loads), synced


def mark() -> torch.cuda.Event | float:
    """A point on the device's timeline: a CUDA event recorded on the current stream (read
    after the run: no sync), or on the CPU, where forwards run synchronously, the clock."""
    if not torch.cuda.is_available():
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class Timeline:
    """CUDA events around the runners' forwards, and the host's time blocked in its reads."""

    def __init__(self, engine: BackoffEngine) -> None:
        self.engine = engine
        self.pairs: list[tuple[str, torch.cuda.Event | float, torch.cuda.Event | float]] = []  # (label, mark, mark)
        self.read_s = 0.0
        self.reads = 0
        self._undo: list = []

    def __enter__(self) -> Timeline:
        for runner in self.engine.models:  # a padded forward (a replay or eager); a ragged one
            if hasattr(runner, "_run"):  # StaticRunner (per-session caches: not timed)
                self._wrap(runner, "_run", f"{runner.name} padded")
            if getattr(runner, "graphs", None) is not None:
                self._wrap(runner.graphs, "replay_ragged", f"{runner.name} ragged")
        for module in DRAWERS:  # the draws' kernels (sampling over the vocabulary), outside the graphs
            self._wrap(module, "draw", "draws")
        self._wrap_read()
        return self

    def start(self) -> None:
        """What the run's clock counts starts here."""
        self.pairs.clear()
        self.read_s, self.reads = 0.0, 0

    def _wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = mark()
            out = inner(*args, **kwargs)
            self.pairs.append((label, start, mark()))
            return out

        setattr(owner, name, timed)
        self._undo.append((owner, name, inner))

    def _wrap_read(self) -> None:
        """Every read of the step loop waits in host.Read.values (to_host's too)."""
        inner = host.Read.values

        def read(pending):
            t = time.perf_counter()
            out = inner(pending)
            self.read_s += time.perf_counter() - t
            self.reads += 1
            return out

        host.Read.values = read
        self._undo.append((host.Read, "values", inner))

    def __exit__(self, *exc) -> None:
        for owner, name, inner in reversed(self._undo):
            if isinstance(owner, types.ModuleType | type):
                setattr(owner, name, inner)
            else:
                delattr(owner, name)  # the instance's wrapper: the class's method again

    def device_ms(self) -> dict[str, dict]:
        """{label: {"count", "ms"}} of the forwards timed."""
        _sync()
        out: dict[str, dict] = {}
        for label, start, end in self.pairs:
            row = out.setdefault(label, {"count": 0, "ms": 0.0})
            row["count"] += 1
            row["ms"] += start.elapsed_time(end) if isinstance(start, torch.cuda.Event) else 1e3 * (end - start)
        return {label: {"count": v["count"], "ms": round(v["ms"], 1)} for label, v in out.items()}


def run(
    engine: BackoffEngine,
    prompt_ids,
    n: int,
    tokens: int,
    routing: RoutingParams,
    timeline: Timeline | None = None,
    profile: cProfile.Profile | None = None,
) -> Run:
    """n requests together, as batch_scaling.throughput runs them (admission, the prompts'
    forwards, outside the clock, the timeline and the profile; timed apart)."""
    reqs = [
        GenerationRequest(tuple(prompt_ids), SamplingParams(max_tokens=tokens, seed=i, ignore_eos=True), routing)
        for i in range(n)
    ]
    admitted = time.perf_counter()
    rids = [engine.submit(r) for r in reqs]
    _sync()
    if timeline is not None:
        timeline.start()
    start, steps = time.perf_counter(), 0
    if profile is not None:
        profile.enable()
    while engine.has_work():
        engine.step()
        steps += 1
    _sync()
    if profile is not None:
        profile.disable()
    seconds = time.perf_counter() - start
    return Run(seconds, sum(len(engine.finish(r).token_ids) for r in rids), steps, start - admitted)


def top(profile: cProfile.Profile, key: str, count: int) -> list[str]:
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(key).print_stats(count)
    lines = text.getvalue().splitlines()
    at = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return [line.rstrip() for line in lines[at : at + count + 1]]


def measure(engine: BackoffEngine, prompt_ids, n: int, tokens: int, routing: RoutingParams, repeats: int) -> dict:
    run(engine, prompt_ids, 2, 4, routing)  # warm-up: allocator growth, lazy initialisation
    plain = [run(engine, prompt_ids, n, tokens, routing) for _ in range(repeats)]
    seconds = statistics.median(r.seconds for r in plain)
    with Timeline(engine) as timeline:
        timed_s, done, steps, _ = run(engine, prompt_ids, n, tokens, routing, timeline)
    forwards = timeline.device_ms()
    device = sum(v["ms"] for v in forwards.values())
    profile = cProfile.Profile()
    run(engine, prompt_ids, n, tokens, routing, profile=profile)
    return {
        "tok_per_s": round(done / seconds, 1),
        "seconds": round(seconds, 6),
        "steps": steps,
        "admission_ms": round(1e3 * statistics.median(r.admission_s for r in plain), 2),  # outside `seconds`
        "events_run": {
            "seconds": round(timed_s, 6),
            "forwards_device_ms": round(device, 1),  # and the draws' (ms under "forwards")
            "device_idle_ms": round(1e3 * timed_s - device, 1),
            "host_blocked_in_reads_ms": round(1e3 * timeline.read_s, 1),
            "reads": timeline.reads,
            "forwards": forwards,
        },
        "profile_tottime": top(profile, "tottime", 25),
        "profile_cumtime": top(profile, "cumulative", 40),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small")
    ap.add_argument("--large")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")  # on the CPU (a dry run, image_check.sh): float32
    ap.add_argument("--kv-budget", type=int, default=65536)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--streams", default="1,64", help="comma-separated concurrency levels n")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", nargs="+", metavar="LABEL", default=list(ROWS), help=f"of {list(ROWS)}")
    ap.add_argument("--out", default="benchmarks/results/gpu")
    args = ap.parse_args()
    if unknown := [label for label in args.rows if label not in ROWS]:
        ap.error(f"unknown rows {unknown}; the rows are {list(ROWS)}")
    transformers.logging.set_verbosity_error()
    chain = load_chain(args.small, args.large, (), LoadSpec(args.device, args.dtype))
    engine = BackoffEngine.from_chain(chain, kv=KVSpec(args.kv_budget, args.max_len))
    prompt_ids = encode_prompt(chain.tokenizer, PROMPT, chat=bool(chain.tokenizer.chat_template))
    streams = [int(s) for s in args.streams.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    default_share = engine.hold.max_share
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    report = {"device": args.device, "gpu": gpu, "tokens": args.tokens, "repeats": args.repeats, "rows": {}}
    for label in args.rows:
        routing, share = ROWS[label]
        engine.hold.max_share = default_share if share is None else share
        engine.launch_ahead = launched_ahead(label)
        report["rows"][label] = row = {}
        for n in streams:
            row[str(n)] = cell = measure(engine, prompt_ids, n, args.tokens, routing, args.repeats)
            e = cell["events_run"]
            print(
                f"{label:30s} n={n:<3d} {cell['tok_per_s']:8.0f} tok/s  {cell['steps']:4d} steps  "
                f"wall {1e3 * e['seconds']:6.1f} ms = device {e['forwards_device_ms']:6.1f} + idle "
                f"{e['device_idle_ms']:6.1f}; blocked in {e['reads']} reads {e['host_blocked_in_reads_ms']:6.1f}  "
                f"{ {k: (v['count'], v['ms']) for k, v in e['forwards'].items()} }; admission {cell['admission_ms']} ms",
                flush=True,
            )
            (out / "step_timeline.json").write_text(json.dumps(report, indent=1) + "\n")
        base = row[str(streams[0])]["tok_per_s"]
        row["x_first"] = {str(n): round(row[str(n)]["tok_per_s"] / base, 2) for n in streams}
        print(f"{label:30s} x n={streams[0]}: {row['x_first']}", flush=True)
    engine.hold.max_share = default_share
    engine.launch_ahead = False
    (out / "step_timeline.json").write_text(json.dumps(report, indent=1) + "\n")
    for label, row in report["rows"].items():
        cell = row[str(streams[-1])]
        print(f"\n{label}, n={streams[-1]}: host functions by own time")
        print("\n".join(cell["profile_tottime"][:18]))
    print(f"saved {out / 'step_timeline.json'}")


if __name__ == "__main__":
    main()
