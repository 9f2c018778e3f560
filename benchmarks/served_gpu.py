"""The served path beside the in-process engine on one device, in one run (issue 55; docs/gpu.md).

    python benchmarks/served_gpu.py --small /tmp/pair/small --large /tmp/pair/large --device cuda \
        --dtype bfloat16 --kv-budget 65536 --max-len 1024 --tag h200     # scripts/gpu_bench.sh served
    python benchmarks/served_gpu.py --device cpu                         # the dry run: tiny pair, ~2 min

1. In process: the engine over the pair with the replicas' settings (static KV and graphs as
   `auto` makes them, M_S's steps launched ahead as the SmallModel resolves `launch_ahead: auto`,
   no prefix cache), rows `random b=0.9` and `always-large` at each stream count
   (batch_scaling.throughput), then the tokens of CHECK_SEEDS one-stream requests; then freed.
2. Served: a local Ray and the packaged app on loopback (harness.loopback_config): one SmallModel
   and one LargeModel replica sharing the device (`gpus: auto`, half a GPU each), the Ingress on the
   CPU; streaming HTTP and gRPC clients through Serve's proxy at each stream count and routing; the
   CHECK_SEEDS requests again, one at a time, whose tokens must equal the in-process ones; what each
   replica resolved (its info(): static KV, graphs, compiled layers, launch_ahead).
Saves OUT/served-TAG.json after every part (a run cut at --deadline keeps what it measured).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams  # noqa: E402

PROMPT = "Write a short paragraph about the history of the Python programming language."
# label -> the wire fields of a row's requests (greedy, as batch_scaling's rows: SamplingParams' default)
ROUTINGS = {
    "random b=0.9": {"router": "random", "thresholds": [0.9], "temperature": 0.0},
    "always-large": {"router": "always-large", "temperature": 0.0},
}
CHECK_SEEDS = (0, 1, 2)  # one-stream requests whose served tokens must be the in-process ones
CHECK_TEMPERATURE = 1.0  # the check's requests sample, seeded (the rows are greedy, as batch_scaling's)
TRANSPORTS = ("http", "grpc")


@dataclass(frozen=True)
class Plan:
    small: str | None
    large: str | None
    device: str
    dtype: str
    kv_budget: int
    max_len: int
    streams: tuple[int, ...]
    tokens: int
    repeats: int
    routings: tuple[str, ...]
    transports: tuple[str, ...]
    deadline_s: float


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", help="M_S's directory (default: the tiny random pair, built under --models-dir)")
    ap.add_argument("--large")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the dry run")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--kv-budget", type=int, default=None, help="KV positions per model (default 65536; cpu 4096)")
    ap.add_argument("--max-len", type=int, default=None, help="positions per KV slot (default 1024; cpu 256)")
    ap.add_argument("--streams", type=int, nargs="+", default=None, help="default 1 16 64 (cpu: 1 4)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per stream (default 64; cpu 8)")
    ap.add_argument("--repeats", type=int, default=2, help="in-process repeats of each cell (median kept)")
    ap.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=list(ROUTINGS))
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS))
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds: parts that would start later are skipped")
    ap.add_argument("--models-dir", default="runs/served_gpu", help="where the tiny pair is built")
    ap.add_argument("--out", default=None, help="default benchmarks/results/gpu (cpu: runs/served_gpu)")
    ap.add_argument("--tag", default="dry")
    return ap.parse_args(argv)


def plan(args: argparse.Namespace) -> Plan:
    """The run's settings: the GPU stage's defaults, or on the CPU a dry run small enough for minutes."""
    cpu = args.device == "cpu"
    small, large = args.small, args.large
    if small is None or large is None:
        from benchmarks.pairs import prepare_pair

        small, large = prepare_pair("tiny", Path(args.models_dir))
    return Plan(
        small=small,
        large=large,
        device=args.device,
        dtype=args.dtype or ("float32" if cpu else "bfloat16"),
        kv_budget=args.kv_budget or (4096 if cpu else 65536),
        max_len=args.max_len or (256 if cpu else 1024),
        streams=tuple(args.streams or ((1, 4) if cpu else (1, 16, 64))),
        tokens=args.tokens or (8 if cpu else 64),
        repeats=args.repeats,
        routings=tuple(args.routings),
        transports=tuple(args.transports),
        deadline_s=args.deadline,
    )


def served_config(p: Plan, http_port: int, grpc_port: int) -> dict:
    """The packaged app on loopback with the pair on p.device: the two models' replicas share the
    device (`gpus: auto`: half the one GPU each, 0 on the CPU), the Ingress none; admission and
    queues wide enough for the most streams; no prefix cache (the in-process rows have none, and
    a repeated prompt would be served from it)."""
    from deployments import harness

    config = harness.loopback_config(p.small, p.large, http_port, grpc_port)
    config["applications"][0]["route_prefix"] = "/backoff"  # where serve_overhead.Clients sends an app's requests
    args = config["applications"][0]["args"]
    args["models"].update(
        device=p.device, dtype=p.dtype, kv_budget_tokens=p.kv_budget, kv_max_len=p.max_len, prefix_cache_tokens=0
    )
    for part in ("small", "large"):
        args[part]["gpus"] = "auto"
    args["ingress"]["gpus"] = "none"
    live = max(p.streams)
    args["admission"] = {**args.get("admission", {}), "max_live_requests": live, "max_waiting_requests": 8}
    args["small"].update(max_ongoing_requests=live + 32, max_queued_requests=live + 32)
    args["limits"] = {**args.get("limits", {}), "max_concurrent_per_client": None}
    if "grpc" not in p.transports:  # HTTP alone: the proxy loads no servicer (an image's grpcio too old for it)
        config["grpc_options"]["grpc_servicer_functions"] = []
    return config


def routing_params(label: str) -> RoutingParams:
    """The engine's RoutingParams of a row (the same decisions as its wire fields, seed for seed)."""
    spec = ROUTINGS[label]
    return RoutingParams(router=spec["router"], thresholds=tuple(spec["thresholds"]) if "thresholds" in spec else None)


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 and p99 in ms of seconds (0 without values)."""
    if len(values) < 2:
        return {"p50": 1e3 * values[0] if values else 0.0, "p99": 1e3 * values[0] if values else 0.0}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": 1e3 * statistics.median(values), "p99": 1e3 * q[98]}


def ratios(tok_per_s: dict) -> dict:
    """served / in-process tok/s per transport, routing and stream count (where both were measured)."""
    base = tok_per_s.get("in_process", {})
    out: dict = {}
    for transport, rows in tok_per_s.items():
        if transport == "in_process":
            continue
        for routing, cells in rows.items():
            for n, value in cells.items():
                if (ref := base.get(routing, {}).get(n)) and value:
                    out.setdefault(transport, {}).setdefault(routing, {})[n] = round(value / ref, 3)
    return out


def compare(expected: dict[int, list[int]], got: dict[int, list[int]]) -> dict:
    """The served tokens of each seed against the in-process ones."""
    differ = {seed: _first_difference(expected[seed], got.get(seed, [])) for seed in expected}
    differ = {seed: at for seed, at in differ.items() if at is not None}
    return {"requests": len(expected), "equal": len(expected) - len(differ), "first_difference": differ}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -- in process -------------------------------------------------------------------------------------


def in_process(p: Plan, report: dict, save) -> tuple[list[int], dict[int, list[int]]]:
    """The engine's rows and the CHECK_SEEDS tokens; the engine freed at the end."""
    import torch
    import transformers

    from backoff_core.engine import ahead
    from backoff_core.engine.engine import CATCH_UP_WAIT_MS, BackoffEngine
    from backoff_core.models.loading import LoadSpec, load_chain
    from backoff_core.models.prompts import encode_prompt
    from benchmarks.batch_scaling import throughput
    from deployments.serving.models_config import ModelsConfig

    transformers.logging.set_verbosity_error()
    if p.device == "cpu":
        torch.set_num_threads(1)  # as each replica (loopback_config's torch_threads)
    start = time.perf_counter()
    chain = load_chain(p.small, p.large, (), LoadSpec(p.device, p.dtype))
    # the replicas' storage, graphs, compiled layers and ragged catch-ups, as their config resolves them
    models = ModelsConfig.model_validate(served_config(p, 0, 0)["applications"][0]["args"]["models"])
    engine = BackoffEngine.from_chain(chain, kv=models.kv_spec(chain.models[-1]), prefix_cache=None)
    launch = ahead.resolve("auto", engine.models[0])  # what the SmallModel's launch_ahead: auto becomes
    report["in_process"] = {"load_s": round(time.perf_counter() - start, 1), "launch_ahead": launch}
    prompt = list(encode_prompt(chain.tokenizer, PROMPT, chat=bool(chain.tokenizer.chat_template)))
    rows = report["tok_per_s"].setdefault("in_process", {})
    for label in p.routings:
        routing = routing_params(label)
        throughput(engine, prompt, 2, 4, routing, 1, CATCH_UP_WAIT_MS, ahead=launch)  # warm-up
        for n in p.streams:
            cell = throughput(engine, prompt, n, p.tokens, routing, p.repeats, CATCH_UP_WAIT_MS, ahead=launch)
            rows.setdefault(label, {})[str(n)] = round(cell["tok_per_s"], 1)
            report["itl_ms"].setdefault("in_process", {}).setdefault(label, {})[str(n)] = {
                "p50": round(cell["itl_median_ms"], 2),
                "p99": round(cell["itl_p99_ms"], 2),
            }
            save()
    tokens = {}
    routing = routing_params("random b=0.9")
    for seed in CHECK_SEEDS:
        request = GenerationRequest(
            tuple(prompt),
            SamplingParams(max_tokens=p.tokens, temperature=CHECK_TEMPERATURE, seed=seed, ignore_eos=True),
            routing,
        )
        tokens[seed] = list(engine.generate_many([request])[0].token_ids)
    del engine, chain
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the replicas take the card next
    return prompt, tokens


# -- served -----------------------------------------------------------------------------------------


async def _stream(client, prompt: list[int], seed: int, tokens: int, fields: dict, t0: float):
    """(time to first token, inter-token gaps, token ids) of one streamed request."""
    got, gaps, last, ttft = [], [], None, None
    async for delta in client.stream(prompt, max_tokens=tokens, seed=seed, ignore_eos=True, **fields):
        if delta.token_id is None:
            continue
        now = time.perf_counter()
        ttft = now - t0 if ttft is None else ttft
        if last is not None:
            gaps.append(now - last)
        last = now
        got.append(delta.token_id)
    return ttft, gaps, got


async def _streams(client, prompt, n: int, tokens: int, fields: dict):
    start = time.perf_counter()
    outs = await asyncio.gather(*[_stream(client, prompt, i, tokens, fields, start) for i in range(n)])
    return outs, time.perf_counter() - start


def served(p: Plan, prompt: list[int], expected: dict[int, list[int]], report: dict, save, left) -> None:
    """Deploy the app, measure every (routing, transport, streams) cell, check the tokens, read the replicas."""
    import yaml
    from ray import serve

    from benchmarks.serve_overhead import Clients
    from deployments import harness, serve_cli
    from tests.support.ray_local import start_local_ray

    http_port, grpc_port = harness.free_port(), harness.free_port()
    start = time.perf_counter()
    start_local_ray(_system_config=serve_cli.RAY_SYSTEM_CONFIG)
    clients = None
    try:
        config_path = Path(report["out"]) / "served_gpu.yaml"
        config_path.write_text(yaml.safe_dump(served_config(p, http_port, grpc_port)))
        assert serve_cli.main(["--config", str(config_path), "--non-blocking"]) == 0
        harness.wait_until_running("backoff", timeout_s=max(60.0, left() - 60))
        report["served"] = {"deploy_s": round(time.perf_counter() - start, 1)}
        report["replicas"] = replica_info()
        save()
        clients = Clients(
            {("backoff", "http"): f"http://127.0.0.1:{http_port}", ("backoff", "grpc"): f"127.0.0.1:{grpc_port}"}
        )
        for transport in p.transports:  # connections and first requests
            clients.run(
                _streams(clients.get("backoff", transport), prompt, max(p.streams), 4, ROUTINGS["random b=0.9"])
            )
        for transport in p.transports:
            got = {seed: clients.run(_stream(clients.get("backoff", transport), prompt, seed, p.tokens,
                                             {**ROUTINGS["random b=0.9"], "temperature": CHECK_TEMPERATURE},
                                             time.perf_counter()))[2]
                   for seed in CHECK_SEEDS}  # fmt: skip
            report["tokens_equal"][transport] = compare(expected, got)
        save()
        for label in p.routings:
            for transport in p.transports:
                for n in p.streams:
                    key = f"{transport} {label} n={n}"
                    if left() < 20:
                        report["errors"][key] = "skipped: past the deadline"
                        continue
                    try:
                        outs, seconds = clients.run(_streams(clients.get("backoff", transport), prompt, n, p.tokens,
                                                             ROUTINGS[label]))  # fmt: skip
                    except Exception as exc:  # noqa: BLE001 - reported, the other cells go on
                        report["errors"][key] = f"{type(exc).__name__}: {exc}"
                        continue
                    done = sum(len(t) for _, _, t in outs)
                    if done != n * p.tokens:
                        report["errors"][key] = f"{done} tokens of {n * p.tokens}"
                    report["tok_per_s"].setdefault(transport, {}).setdefault(label, {})[str(n)] = round(
                        done / seconds, 1
                    )
                    report["ttft_ms"].setdefault(transport, {}).setdefault(label, {})[str(n)] = percentiles(
                        [t for t, _, _ in outs]
                    )
                    report["itl_ms"].setdefault(transport, {}).setdefault(label, {})[str(n)] = percentiles(
                        [g for _, gs, _ in outs for g in gs]
                    )
                    save()
        report["replicas"] = replica_info()  # after the runs: graphs captured, rows launched ahead
    finally:
        if clients is not None:
            clients.close()
        serve.shutdown()
        import ray

        ray.shutdown()


def replica_info() -> dict:
    """What the SmallModel and LargeModel replicas resolved (their info())."""
    from ray import serve

    out = {}
    for name in ("SmallModel", "LargeModel"):
        info = serve.get_deployment_handle(name, app_name="backoff").info.remote().result(timeout_s=60)
        fields = dataclasses.asdict(info)
        keep = ("resolved", "launched_ahead", "kv_budget_tokens", "pid", "steps", "forward_passes", "batch_sizes")
        out[name] = json.loads(json.dumps({k: fields[k] for k in keep if k in fields}, default=str))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    p = plan(args)
    t0 = time.perf_counter()
    left = lambda: p.deadline_s - (time.perf_counter() - t0)
    out = Path(args.out or ("runs/served_gpu" if p.device == "cpu" else "benchmarks/results/gpu"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"served-{args.tag}.json"
    report = {"plan": dataclasses.asdict(p), "out": str(out), "tok_per_s": {}, "ttft_ms": {}, "itl_ms": {},
              "errors": {}, "tokens_equal": {}}  # fmt: skip
    if p.device.startswith("cuda"):
        import torch

        report["gpu"] = torch.cuda.get_device_name()

    def save() -> None:
        report["served_over_in_process"] = ratios(report["tok_per_s"])
        report["seconds"] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(report, indent=2))

    prompt, expected = in_process(p, report, save)
    if left() > 60:
        try:
            served(p, prompt, expected, report, save, left)
        except Exception as exc:  # noqa: BLE001 - the file says why the served half is missing
            report["errors"]["served"] = f"{type(exc).__name__}: {exc}"
    else:
        report["errors"]["served"] = "skipped: past the deadline"
    save()
    print(
        json.dumps({k: report[k] for k in ("tok_per_s", "served_over_in_process", "tokens_equal", "errors")}, indent=2)
    )
    print(f"saved {path}")
    equal = all(c["equal"] == c["requests"] for c in report["tokens_equal"].values()) and report["tokens_equal"]
    return 0 if equal and not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
