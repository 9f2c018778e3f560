"""For tests and benchmarks: a Serve app on this machine's loopback, its ports, and waiting
for it to run. Not part of `backoff serve` (serve_cli.py), which deploys a user's config."""

from __future__ import annotations

import random
import socket
import time

import yaml

from deployments.serve_cli import DEFAULT_CONFIG

PORTS_FROM = 20000  # above Ray's worker ports (10002-19999 by default)
_RNG = random.Random()  # not the global one, which tests seed
_GIVEN: set[int] = set()  # ports this process handed out: two picks never collide


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 and on [::] (where the gRPC proxy binds), below
    the kernel's ephemeral range. Every outgoing connection takes its local port from that
    range, and Ray's processes open hundreds as they start: a port picked there (bind to 0)
    and released could be one of theirs by the time the proxy binds it ("Failed to bind")."""
    top = _ephemeral_start()
    for _ in range(200):
        port = _bindable(_RNG.randrange(PORTS_FROM, top) if top - PORTS_FROM >= 1000 else 0)
        if port and port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError("no free TCP port on loopback")


def _bindable(port: int) -> int:
    """port (0: one the kernel picks) if it binds on 127.0.0.1 and, where there is IPv6, on
    [::] now; else 0."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            port = s.getsockname()[1]
    except OSError:
        return 0
    try:
        six = socket.socket(socket.AF_INET6)
    except OSError:  # no IPv6 here: nothing binds there
        return port
    with six:
        try:
            six.bind(("::", port))
        except OSError:
            return 0
    return port


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


DRAIN_POLL_S = 0.2


def loopback_config(
    small: str | None,
    large: str | None,
    http_port: int,
    grpc_port: int,
    *,
    threads: int = 1,
    replicas: dict[str, int] | None = None,
) -> dict:
    """The packaged Serve config on 127.0.0.1 (one application, `backoff`) with these models
    (None, None: the default pair) on CPU, fixed replica counts (default one each) and no CPU
    reservations -- what tests and benchmarks start on one machine. A stopping replica looks
    for requests still running every DRAIN_POLL_S (Serve's default: 2 s), so an idle app goes
    down in ~1.5 s instead of ~8 s; one with requests still waits for them as long as before."""
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    config["grpc_options"]["port"] = grpc_port
    args = config["applications"][0]["args"]
    args["models"].update(small=small, large=large, device="cpu")
    args["torch_threads"] = threads
    for part in ("small", "large", "ingress"):
        args[part].update(num_replicas=(replicas or {}).get(part, 1), num_cpus=0)
    deployments = config["applications"][0]["deployments"]
    if "Ingress" not in {d["name"] for d in deployments}:
        deployments.append({"name": "Ingress"})
    for d in deployments:
        d["graceful_shutdown_wait_loop_s"] = DRAIN_POLL_S
    return config


def wait_until_running(app: str = "backoff", timeout_s: float = 300.0) -> None:
    """Block until the application reports RUNNING (raises on DEPLOY_FAILED or timeout)."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"application {app!r} failed to deploy: {status.message}")
        time.sleep(0.5)
    raise TimeoutError(f"application {app!r} not running after {timeout_s:.0f} s")


def direct_endpoints(app: str = "backoff") -> dict[str, list[str]]:
    """Under Serve's direct ingress (serve_cli.direct_ingress_env), the loopback endpoints of
    `app`'s Ingress replicas: {"http": ["http://127.0.0.1:PORT", ...], "grpc": ["127.0.0.1:PORT",
    ...]}, from the controller's target groups (no lists without direct ingress)."""
    from ray.serve.context import _get_global_client

    found: dict[str, list[str]] = {}
    for group in _get_global_client().get_serve_details().get("target_groups", []):
        if group.get("app_name") != app:
            continue
        protocol = "http" if str(group["protocol"]).upper().endswith("HTTP") else "grpc"
        for target in group["targets"]:
            address = f"127.0.0.1:{target['port']}"
            found.setdefault(protocol, []).append(f"http://{address}" if protocol == "http" else address)
    return found


def wait_for_direct_endpoints(app: str = "backoff", timeout_s: float = 60.0) -> dict[str, str]:
    """{"http": URL, "grpc": host:port} of `app`'s first Ingress replica under direct ingress,
    once the controller publishes both (a TimeoutError after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while not ((found := direct_endpoints(app)).get("http") and found.get("grpc")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"application {app!r} published no direct endpoints in {timeout_s:.0f} s: {found}")
        time.sleep(0.5)
    return {"http": found["http"][0], "grpc": found["grpc"][0]}
