"""The step loop's own host time: engine steps over a tiny model pair, with the time spent
inside the models' forwards taken out, so what is measured is the Python and tensor
bookkeeping around them.

    python benchmarks/step_overhead.py            # n = 1, 16, 64 streams; always-small and random b=0.9

On a GPU a captured M_S step of a whole batch takes ~1-2 ms; host work per step of the same
order would halve the speed the graphs buy. The tiny forward is not free on a CPU (~1.6 ms
for 64 rows of the static forward, op by op), and on a GPU it is a graph replay, so it is
timed apart: the forward itself (`StaticForward.__call__`, what a CUDA graph captures, or
the HF model's forward for per-session caches) is clocked in every step and subtracted.
The uploads, bucketing and read-backs around it stay in the host time.

Time is the step thread's CPU time (`time.thread_time`, torch on one thread): what the host
spends on a step, which a shared, loaded machine does not inflate the way it does wall time
(the wall-clock figures are saved too; on a quiet machine the two agree).

"random b=0.9" runs every catch-up in the step that routes it (catch_up_wait_ms = 0), the most
host work a step has; "random b=0.9, batched catch-ups" runs the engine's default
(docs/batched-catch-ups.md), where a step has a catch-up stage less often; ", launched ahead"
the same with M_S's steps launched ahead (engine launch_ahead, static KV): what its
bookkeeping adds to the host's work (on a GPU that work runs beside M_S's forward; here,
nothing runs beside anything).

Saves benchmarks/results/step_overhead.json: `ms_per_step` (host time: step minus forward,
median over repeats), `total_ms_per_step` (the whole step), `forward_ms_per_step`, and the
same three measured by the wall clock under `wall`.

    python benchmarks/step_overhead.py --replay-forward   # -> step_overhead_replayed.json

replaces each static forward by a stand-in that hands back the outputs its first call of the
same shape computed: what a graph replay leaves to the host (no compute, and none of the
forward's memory traffic, which on a CPU evicts the host code from the caches). The tokens
differ from a real run's; the host work per step is the same code's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from backoff_core.engine.engine import CATCH_UP_WAIT_MS, BackoffEngine
from backoff_core.runners.factory import make_runner
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams

VOCAB = 512


def tiny_pair():
    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")
    pair = []
    for seed, hidden in ((0, 32), (1, 64)):
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            bos_token_id=None,
            eos_token_id=0,
            pad_token_id=0,
        )
        pair.append(LlamaForCausalLM(config).eval())
    return pair, tokenizer


def _now() -> tuple[float, float]:
    return time.thread_time(), time.perf_counter()


def replay_forward(runner) -> None:
    """Its static forward -> the outputs of its first call of the same shape (module docstring)."""
    forward, seen = runner._forward, {}

    def replayed(batch):
        rows, k = batch.input_ids.shape  # the outputs' shapes: [rows, k or 1, V], [rows, k, d]
        key = (rows, 1 if batch.last_only and batch.hidden_layer is None else k, batch.last_only, batch.hidden_layer)
        if key not in seen or batch.keep is not None:
            seen[key] = forward(batch)
        return seen[key]

    runner._forward = replayed


class ForwardClock:
    """CPU and wall seconds spent inside the models' forwards (see the module's docstring)."""

    def __init__(self) -> None:
        self.seconds = (0.0, 0.0)

    def wrap(self, runner) -> None:
        forward = getattr(runner, "_forward", None)
        if forward is not None:  # StaticRunner: the function a CUDA graph captures
            runner._forward = self._timed(forward)
        else:  # ModelRunner: the HF model's forward
            runner.model.forward = self._timed(runner.model.forward)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = _now()
            try:
                return fn(*args, **kwargs)
            finally:
                end = _now()
                self.seconds = tuple(s + e - b for s, b, e in zip(self.seconds, start, end))

        return timed


def ms_per_step(engine, n, tokens, routing, repeats, clock: ForwardClock | None = None) -> dict[str, float]:
    """Medians over repeats of ms per step: total, forward, host (= total - forward), by
    the thread's CPU clock and (wall_*) by the wall clock."""
    clock = clock or ForwardClock()
    totals, forwards = [], []  # (cpu, wall) pairs
    for rep in range(repeats):
        rids = [
            engine.submit(
                GenerationRequest(
                    (3, 4, 5, 6), SamplingParams(max_tokens=tokens, seed=rep * n + i, ignore_eos=True), routing
                )
            )
            for i in range(n)
        ]
        steps, start, forward = 0, _now(), clock.seconds
        while engine.has_work():
            engine.step()
            steps += 1
        end = _now()
        totals.append([(e - b) / steps * 1e3 for b, e in zip(start, end)])
        forwards.append([(e - b) / steps * 1e3 for b, e in zip(forward, clock.seconds)])
        for request_id in rids:
            engine.finish(request_id)
    out = {}
    for i, prefix in enumerate(("", "wall_")):
        host = [t[i] - f[i] for t, f in zip(totals, forwards)]
        out[prefix + "host"] = statistics.median(host)
        out[prefix + "total"] = statistics.median(t[i] for t in totals)
        out[prefix + "forward"] = statistics.median(f[i] for f in forwards)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--replay-forward", action="store_true", help="static KV only, forwards replayed (docstring)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    (small, large), tokenizer = tiny_pair()
    streams = [int(n) for n in args.streams.split(",")]
    routings = {  # label -> (routing, the engine's catch_up_wait_ms)
        "always-small": (RoutingParams(router="always-small"), 0),
        "random b=0.9": (RoutingParams(router="random", rate=0.9), 0),
        "random b=0.9, batched catch-ups": (RoutingParams(router="random", rate=0.9), CATCH_UP_WAIT_MS),
        # M_S's steps launched ahead (engine launch_ahead, static KV only): on a CPU nothing runs
        # beside the host, so this is the bookkeeping it adds, not what it hides on a GPU
        "random b=0.9, batched catch-ups, launched ahead": (RoutingParams(router="random", rate=0.9), CATCH_UP_WAIT_MS),
    }
    table = {}
    load = os.getloadavg()[0]
    storages = (("per-session caches", None), ("static KV", KVSpec(128 * 256, 256)))
    for storage, kv in storages[1:] if args.replay_forward else storages:
        clock = ForwardClock()
        runners = [make_runner(small, "small", kv, small=True), make_runner(large, "large", kv)]
        for runner in runners:
            if args.replay_forward:
                replay_forward(runner)
            clock.wrap(runner)
        engine = BackoffEngine(runners, tokenizer)
        for label, (routing, wait) in routings.items():
            if "launched ahead" in label and kv is None:
                continue  # per-session caches cannot take ids on the device
            engine.catch_up_wait_ms = wait
            engine.launch_ahead = "launched ahead" in label
            ms_per_step(engine, 2, 4, routing, 1, clock)  # warm-up
            table[f"{storage}, {label}"] = {
                str(n): ms_per_step(engine, n, args.tokens, routing, args.repeats, clock) for n in streams
            }
    header = " ".join(f"{'n=' + str(n):>9s}" for n in streams)
    print(f"\n{'host ms per step (CPU)':44s} {header}   at n max: us/request-step, total/forward, wall host")
    for name, row in table.items():
        cells = " ".join(f"{row[str(n)]['host']:9.2f}" for n in streams)
        top = row[str(streams[-1])]
        print(
            f"{name:44s} {cells}   {top['host'] * 1e3 / streams[-1]:.0f}  "
            f"{top['total']:.2f}/{top['forward']:.2f}  {top['wall_host']:.2f}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def pick(key: str) -> dict:
        return {name: {n: v[key] for n, v in row.items()} for name, row in table.items()}

    report = {
        "tokens": args.tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "load_average_at_start": load,
        "clock": "thread CPU time (time.thread_time); wall-clock figures under 'wall'",
        "ms_per_step": pick("host"),  # host time: step - forward
        "total_ms_per_step": pick("total"),
        "forward_ms_per_step": pick("forward"),
        "wall": {
            "ms_per_step": pick("wall_host"),
            "total_ms_per_step": pick("wall_total"),
            "forward_ms_per_step": pick("wall_forward"),
        },
        "load_average_at_end": os.getloadavg()[0],
    }
    if args.replay_forward:
        report["forward"] = "replayed: each static forward hands back its first outputs of the same shape"
    name = "step_overhead_replayed.json" if args.replay_forward else "step_overhead.json"
    (out / name).write_text(json.dumps(report, indent=2))
    print(f"saved {out / name}")


if __name__ == "__main__":
    main()
