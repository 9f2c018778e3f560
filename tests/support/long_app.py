"""The `long` application: tiny models with the default pair's vocabulary (49,152 ids: a row
of float32 logits is 192 KiB, as for SmolLM2) and an 8,192-position context, so the answers
that passed Serve's 4 MiB channel cap (issue 56) can be built on this CPU in seconds. Used by
tests/deployments/test_app_input_sizes.py (beside the bad-input app) and
benchmarks/answer_sizes_served.py (alone), which measure with `score_beside_streams`.

`prefill_chunk_tokens` 8, by the chunked-prefill rule (a chunk's forward about twice a decode
step): here a scored row costs its LM head and a log-softmax / top-k over 49,152 logits, and
in process (two streams, a 3,000-token prompt, one thread) a window of 8 rows made a step
25 ms against 8 ms without (stream gaps p99 / median 1.85), one of 16 rows 35 ms (2.77).
Every token is its own stream message (`stream.max_messages_per_s`), so a stream's gaps are
its steps'.
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import time
from pathlib import Path

import httpx

from tests.support.served_app import CHAT_TEMPLATE
from tests.support.tiny import tiny_model, tiny_tokenizer

VOCAB = 49_152
CONTEXT = 8_192
CHUNK = 8
MODELS = {
    "small": functools.partial(tiny_model, 1, hidden=64, sharpness=30, vocab=VOCAB),
    "large": functools.partial(tiny_model, 2, hidden=64, layers=4, sharpness=30, vocab=VOCAB),
}
OLD_CAP = 4 << 20  # Serve's default RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
# issue 56's chat request within the documented limits whose answer (~5 MB) passed that cap
N32_CHAT = {
    "messages": [{"role": "user", "content": "w3 w4 w5"}],
    "n": 32,
    "max_tokens": 100,
    "logprobs": True,
    "top_logprobs": 20,
    "ignore_eos": True,
}


def prompt_ids(n: int) -> list[int]:
    """n token ids, none special (0 is EOS, 1 unknown)."""
    return [(7 * i + 3) % (VOCAB - 2) + 2 for i in range(n)]


def save_models(root: Path) -> dict[str, str]:
    """The two models and their tokenizer (with a chat template) under root/<name>."""
    tokenizer = tiny_tokenizer(VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    dirs = {}
    for name, build in MODELS.items():
        model = build()
        model.config.max_position_embeddings = CONTEXT  # rope positions are computed, not stored
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def application(base: dict, dirs: dict[str, str], name: str = "long", chunk: int = CHUNK) -> dict:
    """A copy of `base` (an application of a loopback config) over the long models at /<name>:
    the default limits (16 requests per client), no prefix cache, one token a message."""
    app = json.loads(json.dumps(base))
    app.update(name=name, route_prefix=f"/{name}")
    args = app["args"]
    args["models"].update(small=dirs["small"], large=dirs["large"], prefix_cache_tokens=0)
    args["limits"] = {"max_concurrent_per_client": 16}
    args["default_max_tokens"] = 16
    args["prefill_chunk_tokens"] = chunk
    args["stream"] = {"max_messages_per_s": 100_000.0}
    return app


async def _timed_stream(http: httpx.AsyncClient, url: str, seed: int, tokens: int, arrivals: list[float]) -> int:
    body = {"prompt": [3 + seed, 4, 5], "max_tokens": tokens, "stream": True, "ignore_eos": True, "seed": seed}
    got = 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, response.status_code
        async for line in response.aiter_lines():
            if line.startswith("data: {") and (json.loads(line[len("data: ") :])["choices"] or [{}])[0].get("text"):
                arrivals.append(time.perf_counter())  # one token an event (the final one has no text)
                got += 1
    return got


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def score_beside_streams(
    url: str, headers: dict, prompt_tokens: int = 8_000, top: int = 20, streams: int = 2, stream_tokens: int = 300
) -> tuple[httpx.Response, dict]:
    """A `prompt_tokens` prompt scored (echo, logprobs `top`, max_tokens 0) once `streams`
    streams have 20 tokens each; (its response, the figures): the streams' inter-token gaps
    over their lives (as benchmarks/chunked_prefill_served.py counts them), how many fell
    while the prompt was scored, the scoring's time and the answer's size."""

    async def main():
        async with httpx.AsyncClient(timeout=900, headers=headers) as http:
            arrivals: list[list[float]] = [[] for _ in range(streams)]
            tasks = [
                asyncio.create_task(_timed_stream(http, url, i, stream_tokens, arrivals[i])) for i in range(streams)
            ]
            while min(map(len, arrivals)) < 20:
                await asyncio.sleep(0.05)
            body = {"prompt": prompt_ids(prompt_tokens), "max_tokens": 0, "echo": True, "logprobs": top}
            start = time.perf_counter()
            scored = await http.post(f"{url}/v1/completions", json=body)
            end = time.perf_counter()
            counts = await asyncio.gather(*tasks)
            return scored, counts, arrivals, start, end

    scored, counts, arrivals, start, end = asyncio.run(main())
    pairs = [(a, b) for times in arrivals for a, b in zip(times, times[1:])]
    gaps = [b - a for a, b in pairs]
    before = [b - a for a, b in pairs if b <= start]
    median = statistics.median(gaps)
    figures = {
        "prompt_tokens": prompt_tokens,
        "top_logprobs": top,
        "status": scored.status_code,
        "scoring_s": end - start,
        "body_bytes": len(scored.content),
        "stream_tokens": counts,
        "gaps": len(gaps),
        "gaps_during_scoring": sum(1 for a, b in pairs if start <= a and b <= end),
        "itl_median_before_scoring_ms": 1e3 * statistics.median(before) if before else None,
        "itl_median_ms": 1e3 * median,
        "itl_p99_ms": 1e3 * p99(gaps),
        "itl_max_ms": 1e3 * max(gaps),
        "itl_p99_over_median": p99(gaps) / median,
    }
    return scored, figures
