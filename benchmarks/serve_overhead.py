"""The serving path's own cost at GPU step times: the real app around a stand-in engine.

    python benchmarks/serve_overhead.py                      # 2 and 5 ms; 1, 4, 16, 64 streams
    python benchmarks/serve_overhead.py --steps-ms 2 --streams 1 16 --repeats 3

The real deployments (proxy, Ingress, SmallModel with its step-loop thread, LargeModel) and
the real clients (HTTP/SSE and gRPC, clients/), with the SmallModel's engine replaced by
benchmarks/standin.py (`engine_factory`): a step sleeps its step time and commits one token
per stream, no model runs. In-process = the same stand-in stepped in this process. Per
(step time, streams, transport): served / in-process tokens/s (the in-process run just
before each served one: the pair shares the machine's load), the time a token spends in
the path (µs per token of one stream), time to first token, and the CPU each Ray process
used (ps-style, per wall second). Every served stream is checked token by token against
the stand-in's script. Saves benchmarks/results/serve_overhead.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import yaml
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
)  # replicas: benchmarks.standin

from backoff_core.types import GenerationRequest, SamplingParams  # noqa: E402
from benchmarks.serve_load import prepare_pair  # noqa: E402
from benchmarks.standin import StandInEngine, expected_stream  # noqa: E402
from clients.grpc_client import AsyncBackoffGrpcClient  # noqa: E402
from clients.http_client import AsyncBackoffHTTPClient  # noqa: E402

PROMPT = [3, 7, 11, 13]


@dataclass(frozen=True)
class Run:
    step_ms: float
    streams: int
    transport: str  # http, grpc, in-process
    tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50_s: float
    cpu: dict[str, float]  # process -> CPU seconds per wall second during the run


# -- in process -------------------------------------------------------------------------------


def run_in_process(step_ms: float, streams: int, tokens: int) -> Run:
    engine = StandInEngine([None, None], None, step_s=step_ms / 1e3)
    start = time.perf_counter()
    rids = [
        engine.submit(GenerationRequest(tuple(PROMPT), SamplingParams(max_tokens=tokens, seed=i)))
        for i in range(streams)
    ]
    first: dict[str, float] = {}
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter()
        for request_id in events:
            first.setdefault(request_id, now - start)
    seconds = time.perf_counter() - start
    n = sum(len(engine.finish(request_id).token_ids) for request_id in rids)
    return Run(step_ms, streams, "in-process", n, seconds, n / seconds, statistics.median(first.values()), {})


# -- served -----------------------------------------------------------------------------------


async def _one(client, seed: int, tokens: int, t0: float) -> tuple[float, int]:
    """Time to first token; the stream checked against the stand-in's script (every token
    once, in order, with its source and text)."""
    got, ttft = [], None
    async for delta in client.stream(PROMPT, max_tokens=tokens, seed=seed, ignore_eos=True):
        if delta.token_id is not None:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            got.append((delta.token_id, delta.source, delta.text))
    if got != expected_stream(seed, tokens):
        raise AssertionError(f"stream {seed}: {len(got)} tokens differ from the stand-in's script")
    return ttft, len(got)


async def _served(transport: str, target: str, app: str, streams: int, tokens: int):
    if transport == "http":
        client = AsyncBackoffHTTPClient(f"{target}/{app}", timeout=600)
    else:
        client = AsyncBackoffGrpcClient(target, application=app, timeout=600)
    async with client:
        start = time.perf_counter()
        outs = await asyncio.gather(*[_one(client, i, tokens, start) for i in range(streams)])
        return outs, time.perf_counter() - start


def request_floor_ms(transport: str, target: str, app: str, calls: int = 10) -> float:
    """Median latency of a request that does no work (list the models: proxy and Ingress, no
    SmallModel): what Serve's request path costs before any token, the floor under TTFT."""

    async def main() -> float:
        client = (
            AsyncBackoffHTTPClient(f"{target}/{app}")
            if transport == "http"
            else AsyncBackoffGrpcClient(target, application=app)
        )
        async with client:
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                await client.models()
                times.append(time.perf_counter() - start)
            return 1e3 * statistics.median(times)

    return asyncio.run(main())


class CpuMeter:
    """CPU seconds of every Ray process (by its title: ray::ProxyActor, ray::ServeReplica:app:Ingress,
    raylet, ...) and of this client process, between start() and stop()."""

    def __init__(self) -> None:
        self.procs = {}
        me = psutil.Process()
        for p in psutil.process_iter(["cmdline", "name"]):
            title = " ".join(p.info["cmdline"] or [])[:80]
            if p.pid == me.pid:
                self.procs[p.pid] = (p, "client (this process)")
            elif title.startswith("ray::") or p.info["name"] in ("raylet", "gcs_server"):
                self.procs[p.pid] = (p, title.split()[0] if title.startswith("ray::") else p.info["name"])

    def _times(self) -> dict[int, float]:
        out = {}
        for pid, (p, _) in self.procs.items():
            try:
                t = p.cpu_times()
                out[pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    def start(self) -> None:
        self._t0, self._c0 = time.perf_counter(), self._times()

    def stop(self) -> dict[str, float]:
        wall, c1 = time.perf_counter() - self._t0, self._times()
        out: dict[str, float] = {}
        for pid, used in c1.items():
            label = self.procs[pid][1]
            out[label] = out.get(label, 0.0) + (used - self._c0.get(pid, used)) / wall
        return {k: round(v, 3) for k, v in sorted(out.items()) if v >= 0.005}


def run_served(
    transport: str, target: str, app: str, step_ms: float, streams: int, tokens: int, meter: CpuMeter
) -> Run:
    meter.start()
    outs, seconds = asyncio.run(_served(transport, target, app, streams, tokens))
    cpu = meter.stop()
    n = sum(k for _, k in outs)
    return Run(step_ms, streams, transport, n, seconds, n / seconds, statistics.median(t for t, _ in outs), cpu)


def serve_config(small: str, large: str, http_port: int, grpc_port: int, steps_ms: list[float]) -> dict:
    """One application per step time (`standin2` at /standin2 ...), the packaged config's
    deployments, admission wide enough for the most streams."""
    from deployments import harness

    config = harness.loopback_config(small, large, http_port, grpc_port)
    base = config["applications"][0]
    base["args"]["admission"] = {"max_live_requests": 64, "max_waiting_requests": 8}
    base["args"]["small"]["max_ongoing_requests"] = 96
    base["args"]["limits"] = {**base["args"].get("limits", {}), "max_concurrent_per_client": None}
    apps = []
    for ms in steps_ms:
        app = json.loads(json.dumps(base))
        app.update(name=app_name(ms), route_prefix=f"/{app_name(ms)}")
        app["args"]["engine_factory"] = f"benchmarks.standin:engine_{ms:g}ms"
        apps.append(app)
    config["applications"] = apps
    return config


def app_name(step_ms: float) -> str:
    return f"standin{step_ms:g}"


# -- report -----------------------------------------------------------------------------------


def summarise(pairs: dict) -> list[dict]:
    """Per (step, streams, transport): median run, and the paired served / in-process ratios."""
    rows = []
    for (ms, n, transport), served in sorted(pairs.items()):
        ratios = sorted(s.tokens_per_s / i.tokens_per_s for s, i in served)
        ttft_extra = sorted(s.ttft_p50_s - i.ttft_p50_s for s, i in served)
        # the time one token of one stream spends in the serving path beyond its step
        extra_us = sorted(1e6 * n * (1 / s.tokens_per_s - 1 / i.tokens_per_s) for s, i in served)
        mid = sorted((s for s, _ in served), key=lambda r: r.tokens_per_s)[len(served) // 2]
        inproc = statistics.median(i.tokens_per_s for _, i in served)
        cpu_keys = {k for s, _ in served for k in s.cpu}
        rows.append(
            {
                "step_ms": ms,
                "streams": n,
                "transport": transport,
                "repeats": len(served),
                "served_tokens_per_s": statistics.median(s.tokens_per_s for s, _ in served),
                "in_process_tokens_per_s": inproc,
                "ratio": statistics.median(ratios),
                "ratio_min": ratios[0],
                "ratio_max": ratios[-1],
                "overhead_us_per_token": statistics.median(extra_us),
                "ttft_served_ms": 1e3 * statistics.median(s.ttft_p50_s for s, _ in served),
                "ttft_in_process_ms": 1e3 * statistics.median(i.ttft_p50_s for _, i in served),
                "ttft_extra_ms": 1e3 * statistics.median(ttft_extra),
                "cpu": {k: statistics.median(s.cpu.get(k, 0.0) for s, _ in served) for k in sorted(cpu_keys)},
                "median_run": asdict(mid),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'step':>5} {'streams':>7} {'transport':>9} {'served/s':>9} {'inproc/s':>9} {'ratio':>6} "
        f"{'µs/token':>8} {'TTFT':>7} {'+TTFT':>6}  CPU (cores)"
    )
    for r in rows:
        cpu = ", ".join(
            f"{k.replace('ray::', '').replace('ServeReplica:', '')}={v:.2f}" for k, v in r["cpu"].items() if v >= 0.02
        )
        print(
            f"{r['step_ms']:4g}ms {r['streams']:7d} {r['transport']:>9} {r['served_tokens_per_s']:9.0f} "
            f"{r['in_process_tokens_per_s']:9.0f} {r['ratio']:6.2f} {r['overhead_us_per_token']:8.0f} "
            f"{r['ttft_served_ms']:5.1f}ms {r['ttft_extra_ms']:5.1f}  {cpu}"
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for ms in sorted({r["step_ms"] for r in rows}):
        for transport, style in (("http", "o-"), ("grpc", "s--")):
            rs = sorted(
                (r for r in rows if r["step_ms"] == ms and r["transport"] == transport), key=lambda r: r["streams"]
            )
            if rs:
                label = f"{ms:g} ms step, {transport}"
                a.plot([r["streams"] for r in rs], [r["ratio"] for r in rs], style, label=label)
                b.plot([r["streams"] for r in rs], [r["overhead_us_per_token"] for r in rs], style, label=label)
    a.axhline(1.0, color="grey", lw=0.5)
    for ax, title in ((a, "served / in-process tokens/s"), (b, "µs per token of a stream in the serving path")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps-ms", type=float, nargs="+", default=[2.0, 5.0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--transports", nargs="+", default=["http", "grpc"], choices=["http", "grpc"])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    ap.add_argument("--repeats", type=int, default=5, help="(in-process, served) pairs per point; medians kept")
    ap.add_argument("--models-dir", default="runs/serve_load", help="where the tiny pair (idle here) is saved")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    from ray import serve

    from deployments import harness, serve_cli
    from tests.support.ray_local import start_local_ray

    load_at_start = os.getloadavg()
    small, large = prepare_pair("tiny", Path(args.models_dir))
    http_port, grpc_port = harness.free_port(), harness.free_port()
    start_local_ray(_system_config=serve_cli.RAY_SYSTEM_CONFIG)
    pairs: dict[tuple, list[tuple[Run, Run]]] = {}
    try:
        config = serve_config(small, large, http_port, grpc_port, args.steps_ms)
        path = Path(args.models_dir) / "serve_overhead.yaml"
        path.write_text(yaml.safe_dump(config))
        assert serve_cli.main(["--config", str(path), "--non-blocking"]) == 0
        for ms in args.steps_ms:
            harness.wait_until_running(app_name(ms))
        meter = CpuMeter()
        targets = {"http": f"http://127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}"}
        for ms in args.steps_ms:  # warm-up: every process imports and connects once
            for transport in args.transports:
                run_served(transport, targets[transport], app_name(ms), ms, 4, 16, meter)
        points = [(ms, n, t) for ms in args.steps_ms for n in args.streams for t in args.transports]
        floors: dict[str, list[float]] = {}
        for _ in tqdm(range(args.repeats), desc="repeats"):  # interleaved: the box's load drifts
            for transport in args.transports:
                floors.setdefault(transport, []).append(
                    request_floor_ms(transport, targets[transport], app_name(args.steps_ms[0]))
                )
            for ms, n, transport in points:
                inproc = run_in_process(ms, n, args.tokens)
                served = run_served(transport, targets[transport], app_name(ms), ms, n, args.tokens, meter)
                pairs.setdefault((ms, n, transport), []).append((served, inproc))
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()
    rows = summarise(pairs)
    print_table(rows)
    by = {(r["step_ms"], r["streams"], r["transport"]): r for r in rows}
    result = {
        "single_stream_ratio_2ms": by.get((2.0, 1, "http"), {}).get("ratio"),
        "streams16_ratio_2ms": by.get((2.0, 16, "http"), {}).get("ratio"),
        "single_stream_ratio_2ms_grpc": by.get((2.0, 1, "grpc"), {}).get("ratio"),
        "streams16_ratio_2ms_grpc": by.get((2.0, 16, "grpc"), {}).get("ratio"),
        "request_floor_ms": {t: statistics.median(v) for t, v in floors.items()},
        "args": vars(args),
        "cpu_cores": psutil.cpu_count(),
        "load_avg_at_start": load_at_start,
        "load_avg_at_end": os.getloadavg(),
        "serve_env": {k: os.environ.get(k) for k in serve_cli.SERVE_PATH_ENV},  # what Serve's processes ran with
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "serve_overhead" + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(rows, out / f"{stem}.png")
    print(json.dumps({k: v for k, v in result.items() if "ratio" in k or k == "request_floor_ms"}, indent=2))
    print(f"saved {out / stem}.json and .png")


if __name__ == "__main__":
    main()
