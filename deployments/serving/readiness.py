"""When the application can answer (issue 57, item 7). No Ray: Serve's statuses are passed in
(`serve.status()`'s ServeStatus and its ApplicationStatusOverview, read by attribute).

Serve starts the Ingress in seconds and the SmallModel / LargeModel replicas once their
models load; a request sent between waited in Serve's queues, silently, until they ran.
- The Ingress answers 503 + Retry-After (code `not_ready`) instead, until `missing()` says
  every deployment of its application has a running replica (`Readiness`: asked at most
  every `every_s`, and only until the first yes: it latches).
- `backoff serve` prints one ready line with the addresses once every application of its
  config is RUNNING (all its replicas up) and the proxies are healthy (`wait_ready`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


def _running(replica_states: dict) -> int:
    return sum(n for state, n in replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")


def missing(app) -> str:
    """'' when every deployment of `app` (an ApplicationStatusOverview, None: not deployed)
    has a running replica, else what is still starting."""
    if app is None:
        return "the application is not deployed yet"
    waiting = [name for name, d in app.deployments.items() if _running(d.replica_states) == 0]
    if not app.deployments:
        return "its deployments are not created yet"
    if waiting:
        return f"{', '.join(waiting)} {'has' if len(waiting) == 1 else 'have'} no running replica yet"
    return ""


class Readiness:
    """The Ingress's latch: `problem()` is '' once `probe()` said '' (then never asked again),
    else the probe's last answer, at most `every_s` old (concurrent callers share one probe).
    A caller waits at most `wait_s` for an answer (the controller, busy placing replicas on a
    loaded machine, took 37 s to answer the first one): then it is told the server is starting.
    A probe that raises counts as ready: refusing every request because the controller
    could not be asked would be worse than the wait it saves."""

    def __init__(self, probe: Callable[[], Awaitable[str]], every_s: float = 0.5, wait_s: float = 1.0) -> None:
        self.probe, self.every_s, self.wait_s = probe, every_s, wait_s
        self.ready = False
        self._answer, self._asked = "Serve's controller has not said yet", -float("inf")
        self._pending: asyncio.Task | None = None

    async def problem(self) -> str:
        if self.ready:
            return ""
        if time.monotonic() - self._asked >= self.every_s:
            if self._pending is None:
                self._pending = asyncio.ensure_future(self._ask())
            try:
                await asyncio.wait_for(asyncio.shield(self._pending), self.wait_s)
            except TimeoutError:  # still asking: the answer so far
                pass
        return "" if self.ready else self._answer

    async def _ask(self) -> None:
        try:
            self._answer = await self.probe()
        except Exception:  # noqa: BLE001 - cannot tell: serve rather than refuse
            log.warning("readiness: Serve's status could not be read; serving as ready", exc_info=True)
            self._answer = ""
        self.ready = self._answer == ""
        self._asked, self._pending = time.monotonic(), None


def not_running(status, apps: list[str]) -> str:
    """'' when every one of `apps` is RUNNING in `status` (a ServeStatus) and no proxy is still
    starting, else what is not; raises RuntimeError for an application that failed to deploy."""
    for name in apps:
        app = status.applications.get(name)
        state = str(getattr(getattr(app, "status", None), "value", getattr(app, "status", None)))
        if state == "DEPLOY_FAILED":
            raise RuntimeError(f"application {name!r} failed to deploy: {app.message}")
        if app is None:
            return f"application {name!r} is not deployed yet"
        if state != "RUNNING":
            detail = missing(app)
            return f"application {name!r} is {state}" + (f" ({detail})" if detail else "")
    proxies = [str(getattr(p, "value", p)) for p in status.proxies.values()]
    if not proxies or "HEALTHY" not in proxies or "STARTING" in proxies:
        return "Serve's proxies are starting"
    return ""


def wait_ready(
    status: Callable[[], object],
    apps: list[str],
    timeout_s: float | None,
    progress: Callable[[str], None] = lambda line: None,
    every_s: float = 0.5,
    progress_every_s: float = 30.0,
) -> float:
    """Poll `status()` until not_running() is '' (the seconds it took); TimeoutError naming what
    is not up after timeout_s (None: no limit); `progress(line)` every progress_every_s."""
    start = time.monotonic()
    said = start
    while (problem := not_running(status(), apps)) != "":
        now = time.monotonic()
        if timeout_s is not None and now - start >= timeout_s:
            raise TimeoutError(f"not ready after {timeout_s:g} s: {problem}")
        if now - said >= progress_every_s:
            progress(f"still starting after {now - start:.0f} s: {problem}")
            said = now
        time.sleep(every_s)
    return time.monotonic() - start


def ready_line(config: dict, seconds: float) -> str:
    """The one line `backoff serve` prints once ready: where to send requests."""
    http = config.get("http_options", {})
    host, port = http.get("host", "127.0.0.1"), http.get("port", 8000)
    apps = config.get("applications", [])
    routes = ", ".join(f"{a['name']} at {a.get('route_prefix', '/')}" for a in apps)
    line = f"backoff serve: ready after {seconds:.1f} s: HTTP http://{host}:{port} (OpenAI API under /v1)"
    grpc = config.get("grpc_options", {})
    if grpc.get("grpc_servicer_functions"):
        line += f", gRPC {host}:{grpc.get('port', 9000)}"
    return f"{line}; {routes}"
