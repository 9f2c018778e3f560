"""Where M_L's time goes when many streams back off: the shape of every catch-up forward.

    python benchmarks/catch_up_anatomy.py --small /tmp/pair/small --large /tmp/pair/large \
        --device cuda --dtype bfloat16 --kv-budget 65536 --max-len 1024 --out DIR

Two parts, one load:
  1. replay grid: the GPU time of every captured M_L graph that catch-ups use (last logits
     only, no hidden layer), dense and gathered rows x k x L, as the runner timed them at
     load (CUDA events, median of 3; what static_layout.choose weighs);
  2. a run of n streams (--streams, default 64) at random b=0.9 with the engine's default
     catch_up_wait_ms, every M_L forward recorded: its bucket (dense, rows, k, L; a ragged
     forward of T tokens as 1 x T, L 0: KVSpec ragged "auto", the default), the real new
     tokens among its rows x k, and its wall time (synchronised).
The sum over the run says how much of M_L's time the padding took (rows x k - real tokens).
Writes DIR/catch_up_anatomy.json. On the CPU (no graphs) the grid is empty; the run still
records the shapes.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
import transformers

from backoff_core.engine.engine import BackoffEngine
from backoff_core.models.loading import LoadSpec, load_chain
from backoff_core.models.prompts import encode_prompt
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_probes import replay_table  # noqa: E402

PROMPT = "Write a short paragraph about the history of the Python programming language."


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def replay_grid(runner) -> list[dict]:
    """The replay time of every captured M_L graph that catch-ups use (last logits only, no
    hidden layer), as warmup measured it (gpu_probes.replay_table)."""
    if runner.graphs is None:
        return []
    plain = [e for e in replay_table(runner) if e["last_only"] and e["layer"] is None]
    return [{k: e[k] for k in ("dense", "rows", "k", "L", "ms")} for e in plain]


def record_forwards(runner) -> list[dict]:
    """Wrap runner._run: every forward's bucket, real tokens and synchronised wall time."""
    log: list[dict] = []
    run = runner._run
    scratch = runner.kv.scratch

    def timed(plan, columns=None, **kwargs):  # kwargs: on_device (a step launched ahead)
        _sync()
        t = time.perf_counter()
        out = run(plan, columns, **kwargs)
        _sync()
        key = plan.key
        log.append(
            {
                "dense": key.dense,
                "rows": key.rows,
                "k": key.k,
                "L": key.length,
                "last_only": key.last_only,
                "items": len(plan.rows),
                "real": int((plan.positions != scratch).sum()),
                "ms": 1e3 * (time.perf_counter() - t),
            }
        )
        return out

    def timed_ragged(key, ids, positions, token_slots, last):  # a ragged forward (KVSpec ragged "auto")
        _sync()
        t = time.perf_counter()
        out = replay_ragged(key, ids, positions, token_slots, last)
        _sync()
        real = positions != scratch
        log.append(
            {
                "ragged": True,
                "dense": False,
                "rows": 1,
                "k": key.tokens,
                "L": 0,
                "last_only": True,
                "items": len(set(token_slots[real].tolist())),  # an item a slot
                "real": int(real.sum()),
                "ms": 1e3 * (time.perf_counter() - t),
            }
        )
        return out

    runner._run = timed
    if runner.graphs is not None:
        replay_ragged = runner.graphs.replay_ragged
        runner.graphs.replay_ragged = timed_ragged
    return log


def unwrap(runner) -> None:
    """Undo record_forwards."""
    runner.__dict__.pop("_run", None)
    if runner.graphs is not None:
        runner.graphs.__dict__.pop("replay_ragged", None)


def summarise(log: list[dict]) -> dict:
    slots = sum(f["rows"] * f["k"] for f in log)
    real = sum(f["real"] for f in log)
    by_shape = collections.defaultdict(lambda: {"count": 0, "ms": 0.0, "real": 0, "items": 0})
    for f in log:
        name = (
            f"ragged {f['k']}"
            if f.get("ragged")
            else f"{'dense' if f['dense'] else 'gather'} {f['rows']}x{f['k']} L{f['L']}"
        )
        s = by_shape[name]
        s["count"] += 1
        s["ms"] += f["ms"]
        s["real"] += f["real"]
        s["items"] += f["items"]
    return {
        "forwards": len(log),
        "ms": round(sum(f["ms"] for f in log), 1),
        "token_slots": slots,
        "real_tokens": real,
        "real_share": round(real / slots, 3) if slots else None,
        "by_shape": {
            k: {**v, "ms": round(v["ms"], 1)} for k, v in sorted(by_shape.items(), key=lambda kv: -kv[1]["ms"])
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small")
    ap.add_argument("--large")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-budget", type=int, default=65536)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()

    chain = load_chain(args.small, args.large, (), LoadSpec(args.device, args.dtype))
    engine = BackoffEngine.from_chain(chain, kv=KVSpec(args.kv_budget, args.max_len))
    large, small = engine.models[-1], engine.models[0]
    grid = replay_grid(large)
    prompt_ids = encode_prompt(chain.tokenizer, PROMPT, chat=bool(chain.tokenizer.chat_template))
    routing = RoutingParams(router="random", rate=0.9)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None  # which GPU the grid is of
    report = {"device": args.device, "gpu": gpu, "streams": args.streams, "tokens": args.tokens, "grid": grid}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for label, wait in (("batched", engine.catch_up_wait_ms), ("at once", 0.0)):
        engine.catch_up_wait_ms = wait
        large_log, small_log = record_forwards(large), record_forwards(small)
        reqs = [
            GenerationRequest(
                tuple(prompt_ids), SamplingParams(max_tokens=args.tokens, seed=i, ignore_eos=True), routing
            )
            for i in range(args.streams)
        ]
        _sync()
        t = time.perf_counter()
        results = engine.generate_many(reqs)
        _sync()
        seconds = time.perf_counter() - t
        unwrap(large)
        unwrap(small)
        report[label] = {
            "catch_up_wait_ms": wait,
            "seconds": round(seconds, 3),
            "tokens": sum(len(r.token_ids) for r in results),
            "large": summarise(large_log),
            "small": summarise(small_log),
        }
        print(label, json.dumps({k: v for k, v in report[label].items()}, indent=1)[:3000])
        # saved after each label: a stage cut at its deadline keeps the grid and the batched run
        (out / "catch_up_anatomy.json").write_text(json.dumps(report, indent=1) + "\n")
    print(
        "grid:", *(f"{'D' if g['dense'] else 'G'}{g['rows']}x{g['k']} L{g['L']}: {g['ms']} ms" for g in grid), sep="\n"
    )


if __name__ == "__main__":
    main()
