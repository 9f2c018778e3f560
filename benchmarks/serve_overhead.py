"""The serving path's own cost at GPU step times: the real app around a stand-in engine.

    python benchmarks/serve_overhead.py                      # 2 and 5 ms; 1, 4, 16, 64 streams
    python benchmarks/serve_overhead.py --steps-ms 2 --streams 1 16 --repeats 3 --paths direct

The real deployments (proxy, Ingress, SmallModel with its step-loop thread, LargeModel) and
the real clients (HTTP/SSE and gRPC, clients/), with the SmallModel's engine replaced by
benchmarks/standin.py (`engine_factory`): a step sleeps its step time and commits one token
per stream, no model runs. In-process = the same stand-in stepped in this process. Per
(path, step time, streams, transport): served / in-process tokens/s (the in-process run just
before each served one: the pair shares the machine's load), the time a token spends in
the path (µs per token of one stream), time to first token, and the CPU each Ray process
used (ps-style, per wall second). Every served stream is checked token by token against
the stand-in's script. Saves benchmarks/results/serve_overhead.{json,png}.

Two paths, each on a Ray of its own: `proxy` (the default: clients call Serve's proxy on a
node's HTTP / gRPC port) and `direct` (`backoff serve --direct-ingress`: clients call the
Ingress replica's own ports). A client per (path, application, transport) stays open for
the whole run, as a service's clients and load balancers keep their connections: a run
measures requests, not connects (the warm-up opens the connections of the most streams).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import psutil
import yaml
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
)  # replicas: benchmarks.standin

from backoff_core.types import GenerationRequest, SamplingParams  # noqa: E402
from benchmarks.pairs import prepare_pair  # noqa: E402
from benchmarks.serve_overhead_report import headline, plot, print_table, summarise  # noqa: E402
from benchmarks.standin import StandInEngine, expected_stream  # noqa: E402
from clients.grpc_client import AsyncBackoffGrpcClient  # noqa: E402
from clients.http_client import AsyncBackoffHTTPClient  # noqa: E402

PROMPT = [3, 7, 11, 13]


@dataclass(frozen=True)
class Run:
    path: str  # proxy, direct (in-process runs: the path they are paired with)
    step_ms: float
    streams: int
    transport: str  # http, grpc, in-process
    tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50_s: float
    cpu: dict[str, float]  # process -> CPU seconds per wall second during the run


# -- in process -------------------------------------------------------------------------------


def run_in_process(path: str, step_ms: float, streams: int, tokens: int) -> Run:
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
    return Run(path, step_ms, streams, "in-process", n, seconds, n / seconds, statistics.median(first.values()), {})


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


class Clients:
    """One open client per (application, transport) on one event loop (an asyncio.Runner):
    `run(coro)` runs a coroutine there; `get(app, transport)` the client."""

    def __init__(self, targets: dict[tuple[str, str], str]) -> None:
        self.targets = targets  # (app, transport) -> base URL / host:port
        self.runner = asyncio.Runner()
        self.clients: dict[tuple[str, str], object] = {}

    def get(self, app: str, transport: str):
        key = (app, transport)
        if key not in self.clients:  # made on the runner's loop: a gRPC channel binds to it
            target = self.targets[key]
            self.clients[key] = (
                AsyncBackoffHTTPClient(f"{target}/{app}", timeout=600)
                if transport == "http"
                else AsyncBackoffGrpcClient(target, application=app, timeout=600)
            )
        return self.clients[key]

    def run(self, coro):
        return self.runner.run(coro)

    def close(self) -> None:
        async def close_all():
            for client in self.clients.values():
                await client.__aexit__(None, None, None)

        self.runner.run(close_all())
        self.runner.close()


async def _served(client, streams: int, tokens: int):
    start = time.perf_counter()
    outs = await asyncio.gather(*[_one(client, i, tokens, start) for i in range(streams)])
    return outs, time.perf_counter() - start


def request_floor_ms(clients: Clients, app: str, transport: str, calls: int = 10) -> float:
    """Median latency of a request that does no work (list the models: proxy and Ingress, no
    SmallModel): what Serve's request path costs before any token, the floor under TTFT."""

    async def main() -> float:
        client = clients.get(app, transport)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            await client.models()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    return clients.run(main())


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
    clients: Clients, path: str, transport: str, step_ms: float, streams: int, tokens: int, meter: CpuMeter
) -> Run:
    meter.start()
    outs, seconds = clients.run(_served(clients.get(app_name(step_ms), transport), streams, tokens))
    cpu = meter.stop()
    n = sum(k for _, k in outs)
    ttft = statistics.median(t for t, _ in outs)
    return Run(path, step_ms, streams, transport, n, seconds, n / seconds, ttft, cpu)


def serve_config(small: str, large: str, http_port: int, grpc_port: int, steps_ms: list[float]) -> dict:
    """One application per step time (`standin2` at /standin2 ...), the packaged config's
    deployments, admission and queues wide enough for the most streams."""
    from deployments import harness

    config = harness.loopback_config(small, large, http_port, grpc_port)
    base = config["applications"][0]
    base["args"]["admission"] = {"max_live_requests": 64, "max_waiting_requests": 8}
    base["args"]["small"]["max_ongoing_requests"] = 96
    # 64 requests at once wait in the Ingress's router for their replica slots; the packaged 32
    # refused part of such a burst over direct ingress (503, Retry-After)
    base["args"]["small"]["max_queued_requests"] = 96
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


def serve_path(path: str, args, small: str, large: str) -> tuple[dict, dict]:
    """One path on a Ray of its own: deploy, then `measure`. Returns the (path, step, streams,
    transport) -> [(served, in-process)] pairs and the request floors."""
    from ray import serve

    from deployments import harness, serve_cli
    from tests.support.ray_local import start_local_ray

    http_port, grpc_port = harness.free_port(), harness.free_port()
    direct_env = serve_cli.direct_ingress_env(http_port, grpc_port) if path == "direct" else {}
    with mock.patch.dict(os.environ, direct_env):  # Serve's processes inherit it; restored after
        start_local_ray(_system_config=serve_cli.RAY_SYSTEM_CONFIG)
        clients = None
        try:
            config = serve_config(small, large, http_port, grpc_port, args.steps_ms)
            config_path = Path(args.models_dir) / "serve_overhead.yaml"
            config_path.write_text(yaml.safe_dump(config))
            assert serve_cli.main(["--config", str(config_path), "--non-blocking"]) == 0
            targets = {}
            for ms in args.steps_ms:
                harness.wait_until_running(app_name(ms))
                targets.update(app_targets(path, app_name(ms), http_port, grpc_port))
            clients = Clients(targets)
            return measure(clients, path, args)
        finally:
            if clients is not None:
                clients.close()
            serve.shutdown()
            import ray

            ray.shutdown()


def measure(clients: Clients, path: str, args) -> tuple[dict, dict]:
    """Warm up, then the repeats, interleaved (the box's load drifts): per repeat the request
    floors, then every (step, streams, transport) point as an (in-process, served) pair."""
    pairs: dict[tuple, list[tuple[Run, Run]]] = {}
    floors: dict[str, list[float]] = {}
    meter = CpuMeter()
    for ms, transport in itertools.product(args.steps_ms, args.transports):  # imports, connections
        run_served(clients, path, transport, ms, max(args.streams), 16, meter)
    points = [(ms, n, t) for ms in args.steps_ms for n in args.streams for t in args.transports]
    for _ in tqdm(range(args.repeats), desc=f"{path}: repeats"):
        for transport in args.transports:
            floors.setdefault(transport, []).append(request_floor_ms(clients, app_name(args.steps_ms[0]), transport))
        for ms, n, transport in points:
            inproc = run_in_process(path, ms, n, args.tokens)
            served = run_served(clients, path, transport, ms, n, args.tokens, meter)
            pairs.setdefault((path, ms, n, transport), []).append((served, inproc))
    return pairs, {t: statistics.median(v) for t, v in floors.items()}


def app_targets(path: str, app: str, http_port: int, grpc_port: int) -> dict[tuple[str, str], str]:
    """(app, transport) -> where its clients connect: the proxy's ports, or the app's Ingress
    replica's own (as the controller publishes them)."""
    from deployments import harness

    if path == "proxy":
        return {(app, "http"): f"http://127.0.0.1:{http_port}", (app, "grpc"): f"127.0.0.1:{grpc_port}"}
    found = harness.wait_for_direct_endpoints(app)
    return {(app, "http"): found["http"], (app, "grpc"): found["grpc"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps-ms", type=float, nargs="+", default=[2.0, 5.0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--transports", nargs="+", default=["http", "grpc"], choices=["http", "grpc"])
    ap.add_argument("--paths", nargs="+", default=["proxy", "direct"], choices=["proxy", "direct"])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    ap.add_argument("--repeats", type=int, default=5, help="(in-process, served) pairs per point; medians kept")
    ap.add_argument("--models-dir", default="runs/serve_load", help="where the tiny pair (idle here) is saved")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    from deployments import serve_cli

    load_at_start = os.getloadavg()
    small, large = prepare_pair("tiny", Path(args.models_dir))
    pairs: dict[tuple, list[tuple[Run, Run]]] = {}
    floors: dict[str, dict[str, float]] = {}
    for path in args.paths:
        path_pairs, floors[path] = serve_path(path, args, small, large)
        pairs.update(path_pairs)
    rows = summarise(pairs)
    print_table(rows)
    by = {(r["path"], r["step_ms"], r["streams"], r["transport"]): r for r in rows}
    result = {
        # the default path (Serve's proxy) over HTTP, as the issue names them; then every figure per path
        **headline(by, "proxy"),
        "paths": {path: headline(by, path) for path in args.paths},
        "request_floor_ms": floors,
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
    print(json.dumps({k: result[k] for k in ("paths", "request_floor_ms")}, indent=2))
    print(f"saved {out / stem}.json and .png")


if __name__ == "__main__":
    main()
