"""Host time per step with presence, frequency and repetition penalties (and a long
logit_bias), over a long generation.

    python benchmarks/penalty_overhead.py     # 64 streams, 512 tokens each: plain vs penalized

A penalty reads every token before the position it draws at. Recounted on the host at each
draw, its cost grows with the sequence; kept on the device (backoff_core/engine/penalties.py)
it is that of the tokens committed since the last draw. This runs the step loop of
step_overhead.py (tiny pair, static KV, forwards replayed, so what is timed is the host's
work: engine steps on the thread's CPU clock) at 64 streams, random b=0.9 with the default
batched catch-ups, sampled at temperature 0.8, once plain and once per penalty, and reports
the median host ms per step in each quarter of the generation, and each row's last quarter
over the plain row's (a ratio measured in the same run). A logit_bias of 300 ids (the edge's
cap) does not grow with the length, but was uploaded entry by entry at every draw (sampling.py
now caches each request's as one array).

Saves benchmarks/results/penalty_overhead.{json,png}. The tiny pair's vocabulary is 512 ids,
so a sequence has at most 512 distinct ones: a real vocabulary makes a recount dearer still.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from backoff_core.engine.engine import CATCH_UP_WAIT_MS, BackoffEngine
from backoff_core.runners.factory import make_runner
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams
from benchmarks.step_overhead import replay_forward, tiny_pair

ROWS = {
    "plain": {},
    "presence + frequency": dict(presence_penalty=0.3, frequency_penalty=0.5),
    "repetition": dict(repetition_penalty=1.1),
    "all three": dict(presence_penalty=0.3, frequency_penalty=0.5, repetition_penalty=1.1),
    "logit_bias, 300 ids": dict(logit_bias=tuple((t, -1.0) for t in range(10, 310))),  # the edge's cap
}


def run(engine, streams, prompt, tokens, penalties, seed, clock=time.thread_time) -> list[tuple[float, float]]:
    """-> (share of the generation done, host ms by `clock`) per step (gc_pauses.py: the wall
    clock, on which a collection's pause counts, as everything else the thread waits for)."""
    routing = RoutingParams(router="random", rate=0.9)
    ids = [
        engine.submit(
            GenerationRequest(
                tuple(3 + (i + j) % 500 for j in range(prompt)),
                SamplingParams(max_tokens=tokens, seed=seed + i, ignore_eos=True, temperature=0.8, **penalties),
                routing,
            )
        )
        for i in range(streams)
    ]
    per_step, made = [], 0
    while engine.has_work():
        start = clock()
        events = engine.step()
        per_step.append((made / (streams * tokens), (clock() - start) * 1e3))
        made += len(events)
    for request_id in ids:
        engine.finish(request_id)
    return per_step


def replayed_engine(streams: int, length: int) -> BackoffEngine:
    """The tiny pair over static KV of `streams` slots holding `length` positions, forwards
    replayed (step_overhead.replay_forward: the host's work alone), catch-ups batched (the
    engine's default wait)."""
    (small, large), tokenizer = tiny_pair()
    max_len = 1 << (length - 1).bit_length()
    kv = KVSpec(streams * max_len, max_len)
    runners = [make_runner(small, "small", kv, small=True), make_runner(large, "large", kv)]
    for runner in runners:
        replay_forward(runner)
    engine = BackoffEngine(runners, tokenizer)
    engine.catch_up_wait_ms = CATCH_UP_WAIT_MS
    return engine


def _described(params: dict) -> dict:
    """A row's sampling parameters for the report, a logit_bias by its size."""
    bias = params.get("logit_bias")
    return params | ({"logit_bias": f"{len(bias)} ids, {bias[0][1]:+g} each"} if bias else {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = replayed_engine(args.streams, args.prompt + args.tokens)
    run(engine, 2, 8, 8, ROWS["all three"], 0)  # warm-up
    load = os.getloadavg()[0]
    table, curves = {}, {}
    for name, penalties in tqdm(ROWS.items(), desc="rows", unit="row"):
        steps = run(engine, args.streams, args.prompt, args.tokens, penalties, 1000)
        quarters = [[ms for done, ms in steps if q / 4 <= done < (q + 1) / 4] for q in range(4)]
        table[name] = {"quarters_ms": [statistics.median(q) for q in quarters], "steps": len(steps)}
        curves[name] = steps
    plain = table["plain"]["quarters_ms"][-1]
    print(f"\nhost ms per step at {args.streams} streams, {args.tokens} tokens, by quarter of the generation")
    for name, row in table.items():
        row["last_quarter_over_plain"] = row["quarters_ms"][-1] / plain
        cells = " ".join(f"{ms:7.2f}" for ms in row["quarters_ms"])
        print(
            f"{name:22s} {cells}   last quarter / plain {row['last_quarter_over_plain']:.2f}x  ({row['steps']} steps)"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "what": "host ms per engine step (thread CPU time), forwards replayed; medians per quarter of the generation",
        "streams": args.streams,
        "prompt_tokens": args.prompt,
        "tokens": args.tokens,
        "routing": "random b=0.9, batched catch-ups, temperature 0.8",
        "rows": {name: {**_described(ROWS[name]), **row} for name, row in table.items()},
        "load_average": [load, os.getloadavg()[0]],
    }
    (out / "penalty_overhead.json").write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, steps in curves.items():
        done = [d for d, _ in steps]
        ms = [m for _, m in steps]
        window = 15  # a running median: steps are noisy on a shared machine
        smooth = [statistics.median(ms[max(0, i - window) : i + 1]) for i in range(len(ms))]
        ax.plot(done, smooth, label=name)
    ax.set_xlabel("share of the generation done")
    ax.set_ylabel("host ms per step (running median)")
    ax.set_title(f"host time per step: {args.streams} streams, {args.tokens} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "penalty_overhead.png", dpi=120)
    print(f"saved {out / 'penalty_overhead.json'} and .png")


if __name__ == "__main__":
    main()
