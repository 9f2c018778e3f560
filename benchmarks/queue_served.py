"""Concurrency past the live slots on the real Serve app: does load queue instead of shed?

    python benchmarks/queue_served.py                    # tiny pair, 128 concurrent requests
    python benchmarks/queue_served.py --concurrency 192 --tokens 32

The packaged config on loopback (deployments.harness.loopback_config: one SmallModel replica,
its admission defaults: 48 live, the queue `auto`), tiny random models. `--concurrency`
clients each send one streamed completion at once, from one client address (the per-client
limit is off without API keys); every answer is read to its end. Prints and saves
benchmarks/results/queue_served.json: status codes, errors (any non-200 or a stream that ended
without its tokens), time to first token and total latency p50 / p99 / max, and what the
SmallModel replica reports (its live slots, queue depth, refusals past the queue, waits timed out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.served_app import LOCAL, running_app  # noqa: E402


async def _one(http: httpx.AsyncClient, i: int, tokens: int) -> dict:
    body = {"prompt": [3 + i % 11, 4, 5], "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    first, chunks = None, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        status = r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data:") and not line.endswith("[DONE]"):
                first = first or time.monotonic() - start
                chunks += 1
    return {"status": status, "ttft_s": first, "total_s": time.monotonic() - start, "chunks": chunks}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else float("nan")


async def _burst(url: str, n: int, tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        return await asyncio.gather(*[_one(http, i, tokens) for i in range(n)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/queue_served.json"))
    args = ap.parse_args(argv)
    from ray import serve

    with tempfile.TemporaryDirectory() as root, running_app(Path(root)) as app:
        results = asyncio.run(_burst(app.url, args.concurrency, args.tokens))
        info = serve.get_deployment_handle("SmallModel", "backoff").info.remote().result(timeout_s=60)
    LOCAL.close()
    ok = [r for r in results if r["status"] == 200 and r["chunks"] >= args.tokens]
    codes: dict[str, int] = {}
    for r in results:
        codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
    totals, ttfts = [r["total_s"] for r in ok], [r["ttft_s"] for r in ok]
    record = {
        "concurrency": args.concurrency,
        "tokens": args.tokens,
        "status_codes": codes,
        "errors": len(results) - len(ok),
        "ttft_s": {"p50": _pct(ttfts, 0.5), "p99": _pct(ttfts, 0.99), "max": round(max(ttfts, default=0), 3)},
        "total_s": {"p50": _pct(totals, 0.5), "p99": _pct(totals, 0.99), "max": round(max(totals, default=0), 3)},
        "median_total_s": round(statistics.median(totals), 3) if totals else None,
        "small_replica": dict(zip(("live_slots", "queue_depth", "refused_queue_full", "timed_out"), info.admission)),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    return 0 if record["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
