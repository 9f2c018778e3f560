"""The environment Ray and Serve's processes run with, and a local Ray started with it:
Ray's system config for catch-up replies, Serve's fast request path (SERVE_PATH_ENV: in
every Ray node's environment, cluster.yaml's `ray start` and the recipes set the same),
direct ingress, and the hints `backoff serve` prints about a local Ray (its metrics, live
reload from another shell). `backoff serve` (serve_cli.py), the tests' apps and the
benchmarks start Ray through here.
"""

from __future__ import annotations

import os
import sys

# Catch-up replies carry [k, V] float32 logits (V = 49152 for the default pair: 196 KB a
# row). Ray returns objects up to this size inline in the reply instead of through the
# object store, which saves ~3 ms per catch-up on a CPU box. cluster.yaml sets the same.
RAY_SYSTEM_CONFIG = {"max_direct_call_object_size": 4 * 1024 * 1024}

# Ray Serve's own throughput settings (what RAY_SERVE_THROUGHPUT_OPTIMIZED turns on, less
# direct ingress, which adds client-facing ports: `backoff serve --direct-ingress`): the proxy sends requests to the
# Ingress over gRPC instead of Ray actor calls, and a replica runs its user code and its
# handles' router on its main event loop instead of two more threads that hand every request
# and message across with call_soon_threadsafe (the SmallModel keeps its router's own loop:
# app.SMALL_MODEL_ENV). Read by every Serve process at import, so they
# belong in the environment of the Ray nodes (LOCAL_SERVE_ENV below; cluster.yaml's `ray
# start`). benchmarks/serve_overhead.py, 16 streams at a 2 ms step: the proxy's CPU per
# request 15 -> 7 ms, the Ingress's 19 -> 13 ms (README, "serve_overhead").
# RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH: the proxy receives each answer from the Ingress
# over that gRPC path as one message, capped at 4 MiB by default (a 4.95 MB chat answer was a
# plain-text 500): MESSAGE_BYTES, the default of AppArgs.max_message_bytes, which sets it in
# the app's replicas (app.message_env); the proxy reads it from its node's environment.
MESSAGE_BYTES = 256 << 20
# RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH: the middleware each HTTP proxy wraps itself in, so
# the proxy's own answers (a request timeout, backpressure, a replica lost mid-request: plain
# text) reach clients as OpenAI-style JSON errors (deployments/proxy_errors.py)
PROXY_CALLBACK = "deployments.proxy_errors:proxy_middlewares"
SERVE_PATH_ENV = {
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(MESSAGE_BYTES),
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": PROXY_CALLBACK,
}  # not RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE: it would hold a replica's WARNING lines back until 1000 wait

# Serve's controller gives a new proxy 5 s to report ready, then kills it, and `serve run`
# fails with the proxy's ActorDiedError: a loaded 2-core machine can take longer than that
# to import a proxy. A local Ray started here passes its environment to those processes.
LOCAL_SERVE_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", **SERVE_PATH_ENV}


# Serve's direct ingress (`backoff serve --direct-ingress`): each Ingress replica also serves
# HTTP and gRPC on ports of its own, skipping the proxy hop and the proxy's per-request work
# (an HTTP body is otherwise fetched from the proxy by one more call); the proxy keeps the
# usual ports on the head node only. A node's first Ingress replica takes the port after the
# proxy's (8001 / 9001 by default), the next one the port after that, up to DIRECT_PORTS of
# each (a port another process holds is skipped: Serve takes the first free one of the range). benchmarks/serve_overhead.py, 2 ms step, proxy -> direct: time to first token over
# in-process +13.4 -> +5-7 ms HTTP, +6.9 -> +4.3 gRPC; 16 streams 0.78 -> 0.85 (HTTP), 0.84 ->
# 0.90 (gRPC) of the in-process rate (README, "serve_overhead").
DIRECT_PORTS = 100


def direct_ingress_env(http_port: int, grpc_port: int) -> dict[str, str]:
    """The environment of Serve's processes for direct ingress next to proxies on these ports."""
    env = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
    for protocol, port in (("HTTP", http_port), ("GRPC", grpc_port)):
        env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT"] = str(port + 1)
        env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT"] = str(port + 1 + DIRECT_PORTS)
    return env


def local_serve_env() -> None:
    """Put LOCAL_SERVE_ENV into this process's environment (values already set win): call it
    before a local Ray starts."""
    for key, value in LOCAL_SERVE_ENV.items():
        os.environ.setdefault(key, value)


def start_ray(address: str | None = None, metrics_port: int | None = None, **kwargs) -> None:
    """Join the cluster at `address`, or start a local Ray tuned for catch-up replies (its
    Prometheus metrics on `metrics_port`, else a free port) and say how to reach it."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, **kwargs)
    else:
        local_serve_env()
        if metrics_port is not None:
            kwargs["_metrics_export_port"] = metrics_port
        ray.init(address="local", _system_config=RAY_SYSTEM_CONFIG, **kwargs)
        print(local_ray_hints(), file=sys.stderr)


def local_ray_hints() -> str:
    """Where this process's local Ray exports metrics, and what Ray's own CLI needs to reach it."""
    import ray
    from ray._private.worker import get_dashboard_url

    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    lines = [f"backoff serve: Prometheus metrics of this Ray at http://127.0.0.1:{port}/metrics"]
    return "\n".join(lines + live_reload_hint(os.environ.get("RAY_AUTH_MODE"), get_dashboard_url()))


def live_reload_hint(auth_mode: str | None, dashboard: str | None) -> list[str]:
    """The lines that tell how to change the live config from another shell with Ray's CLI.
    A local ray.init() turns Ray's token auth on (RAY_AUTH_MODE=token in this process's
    environment only): Ray's CLI elsewhere sends the token (~/.ray/auth_token) only when told
    the mode, and fails with AuthenticationError without it. The README's words say the same
    (tests/test_docs.py holds them to these lines)."""
    address = f" --address http://{dashboard}" if dashboard else ""
    lines = ["backoff serve: live reload (Ray's `serve status` / `serve deploy`) from another shell:"]
    if auth_mode == "token":
        lines.append("    export RAY_AUTH_MODE=token")
    lines.append(f"    serve deploy EDITED.yaml{address}   # EDITED.yaml: backoff serve --print-config, edited")
    return lines
