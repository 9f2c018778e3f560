"""Answers past Serve's default 4 MiB message cap, through `backoff serve`'s app (issue 56).

    python benchmarks/answer_sizes_served.py             # ~4 min on 2 CPU cores

The `long` application of tests/support/long_app.py alone (tiny models with the default pair's
vocabulary, 49,152 ids, and an 8,192-position context; chunks of 8 rows), one local Ray. Per
case, its status, time and body size: the chat request of n=32 x 100 tokens x top_logprobs 20
(unary and streamed), oracle echo scoring of a 200-token prompt (M_L's KL against M_S's logits,
10 rows a call), a request past limits.max_answer_bytes (refused at once), and an 8,000-token prompt
scored with logprobs 20 while two streams run: their inter-token gaps meanwhile (median, p99,
p99 / median; goal <= 3; `--repeats` runs, the median one reported with every run's
figures in `per_repeat`). `--chunks 0 8` adds the same with chunking off (scoring at
admission, in one pass: the stall it removes; `--off-prompt-tokens`, 2,000 by default, keeps
M_S's full logits over the prompt, 4 B x 49,152 a row, within memory).
Saves benchmarks/results/answer_sizes_served.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results" / "answer_sizes_served.json"
GOAL = 3.0  # the chunked-prefill goal: ITL p99 / median


def _case(response: httpx.Response, seconds: float) -> dict:
    return {"status": response.status_code, "seconds": seconds, "body_bytes": len(response.content)}


def _timed(http: httpx.Client, path: str, body: dict) -> dict:
    start = time.perf_counter()
    response = http.post(path, json=body)
    return _case(response, time.perf_counter() - start) | (
        {"error": response.json()["error"]} if response.status_code >= 400 else {}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--chunks", type=int, nargs="+", default=[8], help="prefill_chunk_tokens (long_app.CHUNK); 0: off"
    )
    parser.add_argument("--off-prompt-tokens", type=int, default=2_000, help="the scored prompt with chunking off")
    parser.add_argument("--repeats", type=int, default=2, help="runs of the scoring beside streams, per chunk size")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import ray
    from ray import serve

    from deployments import harness, serve_cli
    from tests.support import long_app

    load = os.getloadavg()[0]
    port = harness.free_port()
    out: dict = {}
    with tempfile.TemporaryDirectory() as root:
        dirs = long_app.save_models(Path(root))
        config = harness.loopback_config(dirs["small"], dirs["large"], port, harness.free_port())
        base = config["applications"][0]
        config["applications"] = [long_app.application(base, dirs, f"chunk-{c}", c) for c in args.chunks]
        serve_cli.start_ray(include_dashboard=False, log_to_driver=False)
        try:
            started = time.perf_counter()
            serve_cli.run_config(config, blocking=False)
            for c in args.chunks:
                harness.wait_until_running(f"chunk-{c}", timeout_s=900)
            out["deploy_s"] = time.perf_counter() - started
            for c in tqdm(args.chunks, desc="chunk sizes"):
                url = f"http://127.0.0.1:{port}/chunk-{c}"
                out[f"chunk-{c}"] = _cases(url, c, args.off_prompt_tokens, args.repeats, long_app)
        finally:
            serve.shutdown()
            ray.shutdown()
    result = {
        "command": "python benchmarks/answer_sizes_served.py " + " ".join(sys.argv[1:]),
        "setup": {
            "app": "tests/support/long_app.py: tiny Llama models (M_S 2 layers, M_L 4, hidden 64), vocabulary "
            "49,152, context 8,192, fp32, CPU; one replica each; every token its own stream message",
            "old_cap_bytes": long_app.OLD_CAP,
            "load_average_at_start": load,
            "load_average_at_end": os.getloadavg()[0],
        },
        "goal_itl_p99_over_median": GOAL,
        **out,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for c in args.chunks:
        s = out[f"chunk-{c}"]["scored_beside_streams"]
        print(
            f"chunk {c}: scored {s['prompt_tokens']} tokens in {s['scoring_s']:.1f} s "
            f"({s['body_bytes'] / 2**20:.1f} MiB); stream ITL median {s['itl_median_ms']:.1f} ms, "
            f"p99 {s['itl_p99_ms']:.1f} ms, p99/median {s['itl_p99_over_median']:.2f}"
        )
    print(f"saved {args.out}")


def _cases(url: str, chunk: int, off_prompt_tokens: int, repeats: int, long_app) -> dict:
    chat = long_app.N32_CHAT
    oracle = {"prompt": long_app.prompt_ids(200), "max_tokens": 0, "echo": True, "logprobs": 5, "router": "oracle"}
    cases: dict = {}
    with httpx.Client(base_url=url, timeout=900) as http:
        cases["chat_n32_unary"] = _timed(http, "/v1/chat/completions", chat)
        cases["chat_n32_streamed"] = _timed(http, "/v1/chat/completions", {**chat, "stream": True})
        cases["chat_n32_max_tokens_4000_refused"] = _timed(http, "/v1/chat/completions", {**chat, "max_tokens": 4000})
        cases["oracle_echo_200_unary"] = _timed(http, "/v1/completions", oracle)
        cases["oracle_echo_200_streamed"] = _timed(http, "/v1/completions", {**oracle, "stream": True})
    tokens = 8_000 if chunk else off_prompt_tokens
    runs = [long_app.score_beside_streams(url, {}, prompt_tokens=tokens)[1] for _ in range(repeats)]
    numeric = [k for k, v in runs[0].items() if isinstance(v, float)]
    # the median run by p99 / median, and every run's ratio
    ranked = sorted(runs, key=lambda r: r["itl_p99_over_median"])
    cases["scored_beside_streams"] = {
        **ranked[(len(ranked) - 1) // 2],
        "per_repeat": {k: [r[k] for r in runs] for k in numeric},
    }
    return cases


if __name__ == "__main__":
    main()
