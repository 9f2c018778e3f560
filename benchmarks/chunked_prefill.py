"""Chunked prefill on the default pair, in-process: the live streams' inter-token latency
while a long prompt arrives, and the new request's time to first token.

    PYTHONPATH=$PWD python -m benchmarks.chunked_prefill --chunks 0 64 128 256 512 --repeats 3

Per chunk size (0: chunking off) and repeat, a fresh engine runs `--streams` live streams
(short prompts, `--stream-tokens` tokens each, ignore_eos); after `--arrive-at` steps a
request with a `--prompt-tokens` prompt arrives (it generates `--new-tokens`). Every request
routes with the `random` router at rate 0.5 and its own seed, so every run commits the same
tokens from the same models (chunking changes when work happens, not what is computed).
Reported per chunk size, medians over the repeats:
- itl_p99_over_median: the inter-token latencies of the live streams over their whole run
  (prefill steps included), p99 over median; the issue's goal is <= 3
- ttft_s: the new request's submit -> first token, and ttft_over_solo against the same
  request prefilled alone on an idle engine with chunking off (solo_ttft_s)
Prints a table, saves benchmarks/results/chunked_prefill.json and a PNG of both against
the chunk size. The machine is shared and noisy: medians, and the same work in every run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import pydoc_data.topics
import statistics
import time

import torch
from tqdm import tqdm

from backoff_core.engine.engine import CATCH_UP_WAIT_MS, PREFILL_CHUNK_TOKENS, BackoffEngine
from backoff_core.models.loading import load_chain
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams

RESULTS = pathlib.Path(__file__).parent / "results"
GOAL = 3.0


def _text_ids(tok, n: int, skip: int = 0) -> tuple[int, ...]:
    """n token ids of English reference text (pydoc_data.topics: present everywhere)."""
    topics = sorted(pydoc_data.topics.topics)
    ids: list[int] = []
    for name in topics[skip:] + topics[:skip]:
        ids += tok.encode(" ".join(pydoc_data.topics.topics[name].split()))
        if len(ids) >= n:
            return tuple(ids[:n])
    raise ValueError(f"not {n} tokens of text")


def _request(prompt: tuple[int, ...], max_tokens: int, seed: int) -> GenerationRequest:
    return GenerationRequest(
        prompt,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=seed, ignore_eos=True),
        RoutingParams(router="random", rate=0.5),
    )


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def one_run(chain, chunk: int, args, streams: list[tuple[int, ...]], prompt: tuple[int, ...]) -> dict:
    engine = BackoffEngine.from_chain(chain, prefill_chunk_tokens=chunk, catch_up_wait_ms=args.catch_up_wait_ms)
    ids = engine.submit_many([_request(p, args.stream_tokens, seed=i) for i, p in enumerate(streams)])
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    new, submitted, first, step = None, 0.0, None, 0
    tokens = [] if args.keep_tokens else None
    while engine.has_work():
        if step == args.arrive_at:
            submitted = time.perf_counter()
            (new,) = engine.submit_many([_request(prompt, args.new_tokens, seed=99)])
        events = engine.step()
        now = time.perf_counter()
        for rid in ids:
            if rid in events:
                stamps[rid].append(now)
        if new is not None and first is None and new in events:
            first = now - submitted
        step += 1
    results = [engine.finish(rid) for rid in ids + [new]]
    if tokens is not None:
        tokens += [r.token_ids for r in results]
    itl = [b - a for rid in ids for a, b in zip(stamps[rid], stamps[rid][1:])]
    median = statistics.median(itl)
    return {
        "itl_median_ms": 1e3 * median,
        "itl_p99_ms": 1e3 * _p99(itl),
        "itl_max_ms": 1e3 * max(itl),
        "itl_p99_over_median": _p99(itl) / median,
        "ttft_s": first,
        "steps": step,
        "tokens": [list(t) for t in tokens] if tokens is not None else None,
    }


def solo_ttft(chain, prompt: tuple[int, ...]) -> float:
    engine = BackoffEngine.from_chain(chain, prefill_chunk_tokens=0)
    start = time.perf_counter()
    rid = engine.submit(_request(prompt, 1, seed=99))
    while rid not in engine.step():
        pass
    elapsed = time.perf_counter() - start
    engine.finish(rid)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 64, 128, 256, 512], help="0: chunking off")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-prompt-tokens", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--arrive-at", type=int, default=16, help="the step before which the long prompt arrives")
    parser.add_argument(
        "--catch-up-wait-ms",
        type=float,
        default=CATCH_UP_WAIT_MS,
        help="the engine's catch_up_wait_ms (docs/batched-catch-ups.md)",
    )
    parser.add_argument("--keep-tokens", action="store_true", default=True)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "chunked_prefill.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chain = load_chain(None, None)
    tok = chain.tokenizer
    streams = [_text_ids(tok, args.stream_prompt_tokens, skip=i) for i in range(args.streams)]
    prompt = _text_ids(tok, args.prompt_tokens, skip=args.streams)
    solo = []
    runs: dict[int, list[dict]] = {c: [] for c in args.chunks}
    with tqdm(total=args.repeats * (len(args.chunks) + 1), desc="runs") as bar:
        for _ in range(args.repeats):  # chunk sizes interleaved: the machine's noise hits each alike
            solo.append(solo_ttft(chain, prompt))
            bar.update()
            for chunk in args.chunks:
                runs[chunk].append(one_run(chain, chunk, args, streams, prompt))
                bar.update()
    same = len({json.dumps(r["tokens"]) for rs in runs.values() for r in rs}) == 1
    solo_s = statistics.median(solo)

    def summary(rs: list[dict]) -> dict:
        keys = ("itl_median_ms", "itl_p99_ms", "itl_max_ms", "itl_p99_over_median", "ttft_s")
        out = {k: statistics.median(r[k] for r in rs) for k in keys}
        out["ttft_over_solo"] = out["ttft_s"] / solo_s
        out["per_repeat_itl_p99_over_median"] = [r["itl_p99_over_median"] for r in rs]
        return out

    by_chunk = {str(c): summary(rs) for c, rs in runs.items()}
    default = by_chunk.get(str(PREFILL_CHUNK_TOKENS))
    off = by_chunk.get("0")
    result = {
        "command": "PYTHONPATH=$PWD python -m benchmarks.chunked_prefill "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if k not in ("out", "keep_tokens") and v is not None
        ),
        "setup": {
            "pair": "default (embedded SmolLM2-135M pair), fp32, CPU, in-process BackoffEngine",
            "router": "random, rate 0.5, one seed per request (the same tokens in every run)",
            "catch_up_wait_ms": args.catch_up_wait_ms,
            "streams": args.streams,
            "stream_prompt_tokens": args.stream_prompt_tokens,
            "stream_tokens": args.stream_tokens,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "arrive_at_step": args.arrive_at,
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, shared and noisy",
        },
        "goal_itl_p99_over_median": GOAL,
        "default_chunk": PREFILL_CHUNK_TOKENS,
        "itl_p99_over_median": default["itl_p99_over_median"] if default else None,
        "itl_p99_over_median_chunking_off": off["itl_p99_over_median"] if off else None,
        "ttft_s": default["ttft_s"] if default else None,
        "ttft_s_chunking_off": off["ttft_s"] if off else None,
        "solo_ttft_s": solo_s,
        "same_tokens_in_every_run": same,
        "by_chunk": by_chunk,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    _plot(by_chunk, solo_s, args.out.with_suffix(".png"))
    print(f"solo prefill (chunking off, idle engine): time to first token {solo_s:.2f} s")
    print(f"{'chunk':>6} {'ITL median ms':>14} {'p99 ms':>8} {'p99/median':>11} {'TTFT s':>8} {'TTFT/solo':>10}")
    for c, s in by_chunk.items():
        print(
            f"{c if c != '0' else 'off':>6} {s['itl_median_ms']:>14.1f} {s['itl_p99_ms']:>8.1f} "
            f"{s['itl_p99_over_median']:>11.2f} {s['ttft_s']:>8.2f} {s['ttft_over_solo']:>10.2f}"
        )
    print(f"same tokens in every run: {same}; saved {args.out}")


def _plot(by_chunk: dict, solo_s: float, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunks = [c for c in by_chunk if c != "0"]
    if not chunks:
        return
    x = [int(c) for c in chunks]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(x, [by_chunk[c]["itl_p99_over_median"] for c in chunks], "o-", label="chunked")
    if "0" in by_chunk:
        a.axhline(by_chunk["0"]["itl_p99_over_median"], color="red", ls="--", label="chunking off")
    a.axhline(GOAL, color="gray", ls=":", label=f"goal {GOAL:g}")
    a.set(xscale="log", xlabel="prefill_chunk_tokens", ylabel="live streams' ITL p99 / median", yscale="log")
    a.legend()
    b.plot(x, [by_chunk[c]["ttft_s"] for c in chunks], "o-", label="chunked")
    if "0" in by_chunk:
        b.axhline(by_chunk["0"]["ttft_s"], color="red", ls="--", label="chunking off")
    b.axhline(solo_s, color="gray", ls=":", label="solo prefill")
    b.set(xscale="log", xlabel="prefill_chunk_tokens", ylabel="new request's time to first token (s)")
    b.legend()
    fig.suptitle("chunked prefill, default pair on the CPU: 8 live streams, a 2048-token prompt arrives")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
