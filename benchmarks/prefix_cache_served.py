"""The prefix cache through the server: time to first streamed token of /v1/chat/completions
on the default pair (CPU), cold system prompt against warm, with the prefix cache on and off.

    python benchmarks/prefix_cache_served.py --unchunked   # saves benchmarks/results/prefix_cache_served.json
    python benchmarks/prefix_cache_served.py --save-tokenizer runs/tokenizer   # for guidellm, then exit
    python benchmarks/prefix_cache_served.py --guidellm on=runs/guidellm-on.json off=...   # merge its figures

guidellm (a load generator users run, in a venv of its own) against `backoff serve`: the exact
commands are in docs/prefix-cache.md ("Served"); --guidellm keeps the figures of its JSON reports
(TTFT, request latency, ITL) under the results' `guidellm` key, without starting anything.

The real app on a local Ray of this process's own (harness.loopback_config, Serve's default
router: entropy), as two applications side by side: `on` (the default config, a prefix cache of
8192 positions) and `off` (`prefix_cache_tokens: 0` in the models' args, the control); with
--unchunked a third, `on-unchunked` (`prefill_chunk_tokens: 0`). The prefix cache counters of
each (Ray's Prometheus endpoint) say how many positions each model loaded. The
client is the `openai` package streaming over HTTP, as a user's code would call the server.

A cold request brings a ~1024-token system prompt never sent before (a miss), its warm twin the
same system prompt with another user turn. TTFT: from the call to the first streamed chunk that
carries a token. The machine is shared and noisy: medians over --pairs pairs, each pair measured
back to back, the applications interleaved pair by pair (they share the machine's load).
The in-process figures (benchmarks/prefix_cache.py) measure the engine alone: their ratio is the
ceiling of this one, which adds the path (proxy, Ingress, handle calls, SSE) to both sides.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import openai
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # replicas

from benchmarks.prefix_cache import system_prompts  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "prefix_cache_served.json"
# application name -> overrides of the config's app args (on: the config as shipped)
APPS = {"on": {}, "off": {"models": {"prefix_cache_tokens": 0}}}
# --unchunked: a third application, the cache on and chunked prefill off, which locates a loss:
# with chunks, M_L's replica looks up and stores only its first chunk's blocks (docs/prefix-cache.md)
UNCHUNKED = {"on-unchunked": {"prefill_chunk_tokens": 0}}
SUBJECTS = ["a for loop", "the with statement", "slicing", "exceptions", "decorators", "imports", "classes"]


def user_turn(k: int) -> str:
    return f"In two sentences, how do {SUBJECTS[k % len(SUBJECTS)]} work? (question {k})"


def serve_config(http_port: int, threads: int, apps: dict[str, dict]) -> dict:
    """The packaged config on loopback with the default pair, as one application per entry of
    `apps` (name -> overrides of its args; a dict value updates that section)."""
    from deployments import harness

    config = harness.loopback_config(None, None, http_port, harness.free_port(), threads=threads)
    config.pop("grpc_options")  # HTTP only: two applications would need two gRPC servicers
    base = config["applications"][0]
    config["applications"] = []
    for name, overrides in apps.items():
        app = json.loads(json.dumps(base))
        app.update(name=name, route_prefix=f"/{name}")
        for key, value in overrides.items():
            app["args"][key] = app["args"][key] | value if isinstance(value, dict) else value
        config["applications"].append(app)
    return config


def ttft(client: openai.OpenAI, system: str, user: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first streamed token, prompt tokens) of one streamed chat completion."""
    start = time.perf_counter()
    first, prompt_tokens = None, 0
    stream = client.chat.completions.create(
        model="backoff",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    assert first is not None, "the stream carried no token"
    return first, prompt_tokens


def measure(clients: dict[str, openai.OpenAI], systems: list[str], pairs: int, max_tokens: int) -> dict:
    times = {app: {"cold": [], "warm": []} for app in clients}
    prompt_tokens = []
    bar = tqdm(total=pairs * len(clients), desc="cold/warm pairs")
    for i in range(pairs):
        for a, (app, client) in enumerate(clients.items()):
            system = systems[i * len(clients) + a]  # never sent before: the cold request misses
            cold, n = ttft(client, system, user_turn(2 * i), max_tokens)
            warm, _ = ttft(client, system, user_turn(2 * i + 1), max_tokens)
            times[app]["cold"].append(cold)
            times[app]["warm"].append(warm)
            prompt_tokens.append(n)
            bar.set_postfix({app: f"{cold:.1f}/{warm:.1f} s"})
            bar.update()
    bar.close()
    out = {}
    for app, t in times.items():
        cold, warm = statistics.median(t["cold"]), statistics.median(t["warm"])
        out[app] = {
            "cold_s": cold,
            "warm_s": warm,
            "cold_over_warm": cold / warm,
            "cold_all_s": t["cold"],
            "warm_all_s": t["warm"],
        }
    out["prompt_tokens"] = prompt_tokens
    return out


def prefix_counters() -> dict:
    """{application: {model: {counter: value}}} of the prefix cache, from the local Ray's
    Prometheus endpoint (hits, misses, cached_tokens, lookup_tokens, tokens held)."""
    import re
    import urllib.request

    import ray

    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict = {}
    for line in text.splitlines():
        found = re.match(r"ray_backoff_prefix_cache_(\w+?)(?:_total)?\{(.*)\} (\S+)$", line)
        if found:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', found[2]))
            out.setdefault(labels["application"], {}).setdefault(labels["model"], {})[found[1]] = float(found[3])
    return out


def guidellm_summary(report: Path) -> dict:
    """The figures of one guidellm JSON report (one synchronous benchmark) that tell the prefix
    cache apart: TTFT median / p95 / of the first request (the only cold one when every request
    shares one prefix), request latency and ITL medians, and what was sent."""
    data = json.loads(report.read_text())
    (bench,) = data["benchmarks"]
    metrics, spec = bench["metrics"], data["config"]["spec"]
    done = sorted(bench["requests"]["successful"], key=lambda r: r["request_start_time"])

    def stat(name: str, key: str = "median") -> float:
        m = metrics[name]["successful"]
        return m["percentiles"][key] if key.startswith("p") else m[key]

    return {
        "requests": len(done),
        "errored": len(bench["requests"]["errored"]),
        "ttft_median_ms": stat("time_to_first_token_ms"),
        "ttft_p95_ms": stat("time_to_first_token_ms", "p95"),
        "ttft_first_request_ms": done[0]["time_to_first_token_ms"],
        "ttft_rest_median_ms": statistics.median(r["time_to_first_token_ms"] for r in done[1:]),
        "request_latency_median_s": stat("request_latency"),
        "itl_median_ms": stat("inter_token_latency_ms"),
        "prompt_tokens_median": stat("prompt_token_count"),
        "output_tokens_median": stat("output_token_count"),
        "guidellm_version": data["metadata"]["guidellm_version"],
        "backend": {k: spec["backend"][k] for k in ("target", "request_format", "extras")},
        "data": [{k: v for k, v in d.items() if v not in (None, {}, [])} for d in spec["data"]],
        "profile": spec["profile"]["kind"],
    }


def merge_guidellm(out: Path, reports: list[str]) -> None:
    """results[`guidellm`] = {label: guidellm_summary(report)} for LABEL=REPORT arguments."""
    result = json.loads(out.read_text()) if out.exists() else {}
    runs = {label: guidellm_summary(Path(path)) for label, path in (r.split("=", 1) for r in reports)}
    for label in [label for label in runs if label.startswith("on")]:  # on[-X] beside off[-X]
        off = runs.get("off" + label[2:])
        if off is not None:
            runs[f"ttft_off_over_{label}"] = off["ttft_median_ms"] / runs[label]["ttft_median_ms"]
            runs[f"latency_off_over_{label}"] = (
                off["request_latency_median_s"] / runs[label]["request_latency_median_s"]
            )
    result["guidellm"] = runs
    out.write_text(json.dumps(result, indent=2) + "\n")
    for label, r in runs.items():
        if isinstance(r, dict):
            print(
                f"guidellm {label:>12}: TTFT median {r['ttft_median_ms']:6.0f} ms (first request "
                f"{r['ttft_first_request_ms']:.0f} ms), request latency {r['request_latency_median_s']:.2f} s"
            )
    print(f"saved {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=3, help="cold/warm pairs per application (medians)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--unchunked", action="store_true", help="also an application with chunked prefill off")
    parser.add_argument("--save-tokenizer", type=Path, help="save the default pair's tokenizer here and exit")
    parser.add_argument("--guidellm", nargs="+", metavar="LABEL=REPORT", help="merge guidellm JSON reports and exit")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.guidellm:
        return merge_guidellm(args.out, args.guidellm)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise

    from backoff_core.models.default_pair import load_default_large

    _, tokenizer = load_default_large()
    if args.save_tokenizer:
        tokenizer.save_pretrained(args.save_tokenizer)
        print(f"saved the default pair's tokenizer in {args.save_tokenizer}")
        return
    # token slices of English reference text, as text: ~system_tokens tokens once re-encoded
    apps = APPS | (UNCHUNKED if args.unchunked else {})
    n = len(apps) * args.pairs
    systems = [tokenizer.decode(ids) for ids in system_prompts(tokenizer, n, args.system_tokens)]

    import ray
    from ray import serve

    from deployments import harness, serve_cli

    port = harness.free_port()
    serve_cli.start_ray(include_dashboard=False, log_to_driver=False)
    try:
        start = time.perf_counter()
        serve_cli.run_config(serve_config(port, args.threads, apps), blocking=False)
        for app in apps:
            harness.wait_until_running(app, timeout_s=600)
        print(f"served in {time.perf_counter() - start:.0f} s on http://127.0.0.1:{port}/{{{','.join(apps)}}}")
        clients = {app: openai.OpenAI(base_url=f"http://127.0.0.1:{port}/{app}/v1", api_key="-") for app in apps}
        for client in clients.values():  # warm-up: a short prompt that shares no block with the systems
            ttft(client, "You are terse.", "Say hi.", 2)
        load_before = os.getloadavg()
        timed = measure(clients, systems, args.pairs, args.max_tokens)
        load_after = os.getloadavg()
        time.sleep(15)  # Ray exports metrics every 10 s: the last requests' counters land first
        counters = prefix_counters()
    finally:
        serve.shutdown()
        ray.shutdown()

    result = {
        "ttft_cold_over_warm": {app: timed[app]["cold_over_warm"] for app in apps},
        "applications": apps,
        "headline": "on",
        "router": "entropy (the Serve config's default)",
        "endpoint": "/v1/chat/completions, stream, temperature 0",
        "system_tokens": args.system_tokens,
        "prompt_tokens": timed.pop("prompt_tokens"),
        "max_tokens": args.max_tokens,
        "ttft": timed,
        "prefix_cache_counters": counters,
        "load_average": {"before": load_before, "after": load_after},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads_per_replica": args.threads},
        "command": " ".join(["python benchmarks/prefix_cache_served.py", *sys.argv[1:]]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    if "guidellm" in old:  # written by hand from guidellm's runs (docs/prefix-cache.md): keep it
        result["guidellm"] = old["guidellm"]
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'application':>12} {'cold TTFT':>10} {'warm TTFT':>10} {'cold/warm':>10}")
    for app in apps:
        t = timed[app]
        print(f"{app:>12} {t['cold_s']:9.2f}s {t['warm_s']:9.2f}s {t['cold_over_warm']:9.1f}x")
    print(f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}; saved {args.out}")


if __name__ == "__main__":
    main()
