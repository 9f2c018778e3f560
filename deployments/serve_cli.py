"""`backoff serve`: run the Serve config locally (the same path as `serve run <config>`).

Reads deployments/serve_config.yaml (or --config), applies the command line's overrides,
writes the result to a temporary file and hands it to Ray Serve's own `serve run
--non-blocking`; then waits until every replica runs and prints one ready line with the
addresses (deployments/serving/readiness.py), and keeps serving until Ctrl-C (`--wait-ready`:
exits 0 there instead, for scripts; `--non-blocking`: returns once submitted). The
environment Ray and Serve's processes run with, and the local Ray started with it, are
ray_env.py's.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

from backoff_core.cli.args import AUTO_BOOL, QUANTIZE_CHOICES, auto_bool
from backoff_core.types import COMPILE_MODES, RAGGED_MODES
from deployments.ray_env import (  # noqa: F401 (re-exported: cluster.yaml, the recipes, docs and tests name them here)
    DIRECT_PORTS,
    LOCAL_SERVE_ENV,
    MESSAGE_BYTES,
    PROXY_CALLBACK,
    RAY_SYSTEM_CONFIG,
    SERVE_PATH_ENV,
    direct_ingress_env,
    live_reload_hint,
    local_ray_hints,
    local_serve_env,
    start_ray,
)
from deployments.serving.readiness import ready_line, wait_ready

DEFAULT_CONFIG = Path(__file__).resolve().parent / "serve_config.yaml"


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _budget(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="backoff serve", description="Run backoff decoding on Ray Serve locally.")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="Serve config YAML (default: the packaged one)")
    p.add_argument("--small", help="M_S: local dir, cached HF id or .gguf (none: the embedded default pair)")
    p.add_argument("--large", help="M_L: local dir, cached HF id or .gguf")
    p.add_argument("--medium", action="append", default=None, help="intermediate model(s), smallest first")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", help="float32, bfloat16 or float16")
    p.add_argument(
        "--kv-budget",
        type=_budget,
        dest="kv_budget_tokens",
        help="KV positions per model replica, or auto (default: from free GPU memory, or a fraction "
        "of RAM on CPU, resolved at replica start)",
    )
    p.add_argument(
        "--static-kv",
        choices=AUTO_BOOL,
        help="KV storage: preallocated slots (+ CUDA graphs on a GPU), per-session caches, or auto "
        "(slots on CUDA, per-session caches on CPU)",
    )
    p.add_argument("--kv-max-len", type=int, help="static KV: positions per slot (default 2048)")
    p.add_argument(
        "--small-tp", type=int, metavar="N", help="M_S over N tensor-parallel ranks (models.tensor_parallel)"
    )
    p.add_argument(
        "--large-tp", type=int, metavar="N", help="M_L over N tensor-parallel ranks (models.tensor_parallel)"
    )
    for which in ("small", "large"):
        p.add_argument(
            f"--quantize-{which}",
            choices=QUANTIZE_CHOICES,
            help=f"M_{which[0].upper()}'s weights: fp8 (the decoder's linear layers, docs/fp8.md) or none "
            f"(models.quantize.{which})",
        )
    p.add_argument(
        "--ragged-catch-ups",
        nargs="?",
        choices=RAGGED_MODES,
        const="on",
        help="static KV on a GPU: the large model's catch-ups as ragged forwards, unpadded (docs/gpu.md): auto "
        "(the default; with CUDA graphs, each catch-up ragged where its replays were timed faster), on (alone: "
        "on), off",
    )
    p.add_argument(
        "--compile-layers",
        choices=COMPILE_MODES,
        help="static KV: every decoder layer one inductor-compiled function, fewer kernels a step (docs/gpu.md): "
        "auto (the default; where CUDA graphs capture it), on (also eagerly), off",
    )
    p.add_argument(
        "--launch-ahead",
        nargs="?",
        choices=AUTO_BOOL,
        const="true",
        help="M_S's next step queued before its tokens are read back, hiding the host's work between "
        "steps (docs/gpu.md): auto (the default: where M_S is on static KV on CUDA), true (alone: true; "
        "wherever M_S is on static KV), false",
    )
    p.add_argument("--router", help="decision function (live config)")
    p.add_argument("--threshold", help="threshold(s), comma-separated, ascending (live config)")
    p.add_argument("--target-backoff", type=float, help="target backoff rate (live config)")
    p.add_argument("--no-batching", action="store_true", help="one large-model forward per catch-up call")
    p.add_argument("--host", help="HTTP host (default 127.0.0.1; 0.0.0.0 exposes it: set access.api_keys)")
    p.add_argument("--http-port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default 9000)")
    p.add_argument(
        "--direct-ingress",
        action="store_true",
        help="each Ingress replica also serves on ports of its own (the first: HTTP port + 1, gRPC "
        "port + 1), without the proxy hop: the fast path for clients that can reach a replica's "
        "port; the proxy's ports keep working. Local Ray only: a cluster sets it when its nodes start",
    )
    p.add_argument("--address", help="Ray cluster to deploy to (default: start a local one)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port of the local Ray (default: a free one, printed)")
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        help="the replicas' log level (default INFO: one line per request); DEBUG adds Serve's line for every "
        "call between replicas (each catch-up)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resulting config and exit")
    p.add_argument("--non-blocking", action="store_true", help="return once the config is submitted (no ready line)")
    p.add_argument(
        "--wait-ready",
        type=float,
        nargs="?",
        const=600.0,
        metavar="SECONDS",
        help="for scripts: wait until every replica can answer, print the ready line and exit 0; exit 1 with one "
        "line if not ready within SECONDS (default 600). Needs a Ray that outlives this command: --address "
        "(e.g. auto after `ray start --head`)",
    )
    return p


def _deployment(app: dict, name: str) -> dict:
    deployments = app.setdefault("deployments", [])
    for d in deployments:
        if d.get("name") == name:
            return d
    deployments.append({"name": name})
    return deployments[-1]


# Deployment names that changed, old -> new: a config written for the old name keeps working here
DEPRECATED_DEPLOYMENT_NAMES = {"SmallRouter": "SmallModel"}


def rename_deprecated_deployments(app: dict) -> None:
    """Rewrite deprecated deployment names of one application in place (with a warning)."""
    for d in app.get("deployments", []):
        new = DEPRECATED_DEPLOYMENT_NAMES.get(d.get("name"))
        if new is not None:
            print(
                f"backoff serve: deployment {d['name']!r} is now called {new!r}; rename it in your config",
                file=sys.stderr,
            )
            d["name"] = new


def apply_overrides(config: dict, args: argparse.Namespace) -> dict:
    """The config with the command line's choices written into it (a copy)."""
    config = copy.deepcopy(config)
    app = config["applications"][0]
    rename_deprecated_deployments(app)
    models = app.setdefault("args", {}).setdefault("models", {})
    for key in ("small", "large", "medium", "device", "dtype", "kv_budget_tokens", "kv_max_len"):
        value = getattr(args, key)
        if value is not None:
            models[key] = value
    if args.static_kv is not None:
        models["static_kv"] = auto_bool(args.static_kv)
    if args.ragged_catch_ups is not None:
        models["ragged_catch_ups"] = args.ragged_catch_ups
    if args.compile_layers is not None:
        models["compile_layers"] = args.compile_layers
    for key, value in (("small", args.small_tp), ("large", args.large_tp)):
        if value is not None:
            models["tensor_parallel"] = {**models.get("tensor_parallel", {}), key: value}
    for key, value in (("small", args.quantize_small), ("large", args.quantize_large)):
        if value is not None:
            quantize = models.get("quantize", {})
            quantize = {"small": quantize, "large": quantize} if isinstance(quantize, str) else quantize
            models["quantize"] = {**quantize, key: value}
    if args.launch_ahead is not None:
        app["args"]["launch_ahead"] = auto_bool(args.launch_ahead)
    routing = _deployment(app, "SmallModel").setdefault("user_config", {})
    if args.router is not None or args.threshold is not None:
        routing.pop("threshold", None)  # the deprecated spelling of thresholds: the command line replaces it
    if args.router is not None:
        routing["router"] = args.router
        routing["thresholds"] = None  # the config's thresholds belonged to the config's router
    if args.threshold is not None:
        routing["thresholds"] = [float(t) for t in args.threshold.split(",")]
    if args.target_backoff is not None:
        routing["target_backoff"] = args.target_backoff
    if args.no_batching:
        _deployment(app, "LargeModel").setdefault("user_config", {})["batching"] = False
    if args.log_level is not None:  # Serve's access lines (the proxy's per request, a replica's per call) only at DEBUG
        for part in (app, config):  # the app's replicas; Serve's controller and proxies
            part["logging_config"] = {
                **part.get("logging_config", {}),
                "log_level": args.log_level,
                "enable_access_log": args.log_level == "DEBUG",
            }
    if args.host is not None:
        config.setdefault("http_options", {})["host"] = args.host
    if args.http_port is not None:
        config.setdefault("http_options", {})["port"] = args.http_port
    if args.grpc_port is not None:
        config.setdefault("grpc_options", {})["port"] = args.grpc_port
    return config


def start_serve(config: dict) -> None:
    """Serve's controller and proxies on the Ray this process is connected to, with the
    config's cluster-wide options, its top-level logging_config included: `serve run` hands
    that to neither (its proxies would log an access line per request, whatever the config
    says). Where Serve already runs it keeps its options; without Ray, `serve run` starts both."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.start(
            proxy_location=config.get("proxy_location"),
            http_options=config.get("http_options"),
            grpc_options=config.get("grpc_options"),
            logging_config=config.get("logging_config"),
        )


def run_config(config: dict, blocking: bool = True) -> None:
    """`serve run` of this config, in this process (on the Ray this process is connected to,
    else one `serve run` starts)."""
    from ray.serve.scripts import cli  # Ray only when something is deployed

    local_serve_env()  # used if `serve run` starts a local Ray
    start_serve(config)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="backoff-serve-", delete=False) as f:
        yaml.safe_dump(config, f, sort_keys=False)
    argv = ["run", f.name] + ([] if blocking else ["--non-blocking"])
    try:
        cli.main(args=argv, prog_name="serve", standalone_mode=False)
    finally:  # `serve run` reads it before it deploys: one file per command would pile up in /tmp
        Path(f.name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = apply_overrides(yaml.safe_load(args.config.read_text()), args)
    if args.print_config:
        print(yaml.safe_dump(config, sort_keys=False), end="")
        return 0
    if args.direct_ingress:
        if args.address or ray_is_running():
            print(
                "backoff serve: --direct-ingress is set when Ray starts (the environment of Serve's "
                "processes), so it needs the local Ray this command starts; for a cluster, put "
                "deployments.serve_cli.direct_ingress_env(...) in its nodes' `ray start` environment",
                file=sys.stderr,
            )
            return 2
        http = config.get("http_options", {}).get("port", 8000)
        grpc = config.get("grpc_options", {}).get("port", 9000)
        os.environ.update(direct_ingress_env(http, grpc))
        print(
            f"backoff serve: direct ingress: the Ingress replica serves HTTP on port {http + 1} and gRPC "
            f"on port {grpc + 1} (a port taken, or more replicas: the next free ones, up to {DIRECT_PORTS} "
            f"further); {http} and {grpc} go through the proxy",
            file=sys.stderr,
        )
    if args.wait_ready is not None and not (args.address or ray_is_running()):
        print(
            "backoff serve: --wait-ready returns once the app is ready, and the local Ray this command would "
            "start stops with it: start Ray first (`ray start --head`) and add --address auto, or run "
            "`backoff serve` without it (it prints the ready line and keeps serving)",
            file=sys.stderr,
        )
        return 2
    started = time.monotonic()
    start_ray(args.address, args.metrics_port)
    run_config(config, blocking=False)  # submitted; the wait for the replicas is ours (the ready line)
    if args.non_blocking and args.wait_ready is None:
        return 0
    code = wait_until_ready(config, args.wait_ready, started)
    if code or args.non_blocking or args.wait_ready is not None:
        return code
    serve_until_interrupted()
    return 0


def wait_until_ready(config: dict, timeout_s: float | None, started: float) -> int:
    """Print the ready line once every application of `config` runs (0), or one line saying
    what is not up after timeout_s, or which application failed to deploy (1)."""
    from ray import serve

    apps = [app["name"] for app in config["applications"]]
    try:
        wait_ready(
            serve.status, apps, timeout_s, progress=lambda line: print(f"backoff serve: {line}", file=sys.stderr)
        )
    except (TimeoutError, RuntimeError) as exc:
        print(f"backoff serve: {exc}; `serve status` has the detail", file=sys.stderr)
        return 1
    print(ready_line(config, time.monotonic() - started), flush=True)
    return 0


def serve_until_interrupted() -> None:
    """Keep this process (and a local Ray it started) up, as `serve run` does, until Ctrl-C."""
    from ray import serve

    try:
        while True:
            time.sleep(10)
    except KeyboardInterrupt:
        print("backoff serve: shutting down", file=sys.stderr)
        serve.shutdown()


def ray_is_running() -> bool:
    import ray

    return ray.is_initialized()
