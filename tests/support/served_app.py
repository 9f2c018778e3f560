"""One way to put the Serve application up for a Ray integration module (tests/deployments/
test_app*.py, test_multinode.py), as `backoff serve` does: tiny models saved to disk, the
packaged config on loopback (deployments.harness.loopback_config) with the module's overrides,
`backoff serve --config` into a local Ray, then wait until every application in the config
runs. The module-scoped fixture `serve_app` (tests/deployments/conftest.py) wraps
`running_app`, so Serve goes down after the module's last test. The local Ray stays up for
the next module if it asks for the same options and environment (LOCAL: tiers.RAY_UNITS runs
such modules one after another), and goes down before a module that needs another, and after
the last (tests/deployments/conftest.py).

Ray is imported lazily: collecting these modules must not need it (they skip without it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from backoff_core.engine.engine import BackoffEngine
from backoff_core.models.loading import LoadSpec, load_model
from deployments import harness, serve_cli
from tests.support.helpers import engine_for
from tests.support.ray_local import start_local_ray
from tests.support.tiny import tiny_model, tiny_tokenizer

if TYPE_CHECKING:
    from tests.support.cluster_local import LocalCluster

# chat requests join the messages' contents (tiny_tokenizer has no template of its own)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
# the pair of tests/conftest.py's `pair`: peaky, so the entropy router uses both models
TINY_PAIR: Mapping[str, Callable[[], Any]] = {
    "small": functools.partial(tiny_model, 1, sharpness=30),
    "large": functools.partial(tiny_model, 2, hidden=64, layers=4, sharpness=30),
}
LOCAL_RAY: Mapping[str, Any] = {"num_cpus": 4, "_system_config": serve_cli.RAY_SYSTEM_CONFIG}
ROOT = Path(__file__).resolve().parents[2]
# every local Ray's processes import from the checkout (benchmarks.standin: stand-in engines)
LOCAL_ENV: Mapping[str, str] = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


class LocalRay:
    """The local Ray that consecutive Serve modules share while they ask for the same
    ray.init options and environment: each deploys its app into it (Serve is shut down
    between them) instead of starting an instance of its own, which costs ~16 s on a loaded
    2-core machine, ~25 s with Serve's start. The environment is set before Ray starts
    (its processes inherit it) and restored when it goes down."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.patch: pytest.MonkeyPatch | None = None

    def ensure(self, options: Mapping[str, Any], env: Mapping[str, str]) -> None:
        import ray

        key = repr((sorted(options.items()), sorted(env.items())))
        if key == self.key and ray.is_initialized():
            return
        self.close()
        self.patch = pytest.MonkeyPatch()
        for name, value in env.items():
            self.patch.setenv(name, value)
        start_local_ray(**options)
        self.key = key

    def close(self) -> None:
        import ray

        ray.shutdown()
        if self.patch is not None:
            self.patch.undo()
        self.key, self.patch = None, None


LOCAL = LocalRay()


@dataclass(frozen=True)
class ServedApp:
    """A deployed app. `config` is what was deployed: a test that redeploys edits it (or a copy)."""

    url: str  # the HTTP proxy: http://127.0.0.1:PORT
    grpc_target: str  # the gRPC proxy: 127.0.0.1:PORT
    config: dict
    config_path: Path  # config.yaml in the module's temporary folder (edited copies go beside it)
    model_dirs: Mapping[str, str]  # "small", "large", ... -> the saved model's directory
    metrics_url: str | None = None  # Ray's Prometheus endpoint, when the module chose its port
    dashboard: str | None = None  # Ray's dashboard (`serve status/deploy --address`), when started
    cluster: LocalCluster | None = None  # the multi-node cluster, when the app runs on one


def save_tiny_models(root: Path, models: Mapping[str, Callable[[], Any]]) -> dict[str, str]:
    """Each model with the tiny tokenizer under root/<name>; name -> directory."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    dirs = {}
    for name, build in models.items():
        build().save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def deploy(config: dict, path: Path, *apps: str) -> None:
    """`backoff serve --config path` (written from `config`); then wait until `apps` run."""
    path.write_text(yaml.safe_dump(config))
    assert serve_cli.main(["--config", str(path), "--non-blocking"]) == 0
    for app in apps:
        harness.wait_until_running(app)


def deployment_config(config: dict, name: str, app: int = 0) -> dict:
    """The `deployments:` entry (user_config, autoscaling_config) of one deployment of an app."""
    return {d["name"]: d for d in config["applications"][app]["deployments"]}[name]


@contextlib.contextmanager
def running_app(
    root: Path,
    models: Mapping[str, Callable[[], Any]] = TINY_PAIR,
    *,
    replicas: dict[str, int] | None = None,
    edit: Callable[[dict, Mapping[str, str]], None] | None = None,
    ray_options: Mapping[str, Any] = LOCAL_RAY,
    env: Mapping[str, str] | None = None,
    cluster: Callable[[], LocalCluster] | None = None,
    direct_ingress: bool = False,
) -> Iterator[ServedApp]:
    """Deploy the app (models saved under `root`); Serve is shut down on exit, a cluster too.

    replicas: the loopback config's fixed counts (default one each); edit(config, model_dirs):
    the module's overrides; ray_options: ray.init's, for a local Ray (its `_metrics_export_port`
    and `dashboard_port` become the record's URLs; LOCAL keeps one up while they and env stay
    the same); env: beside LOCAL_ENV, set before Ray starts (its processes inherit it), restored
    once it goes down; cluster: starts a multi-node cluster instead of a local Ray;
    direct_ingress: Serve's direct ingress next to the proxies (serve_cli.direct_ingress_env).
    """
    from ray import serve

    dirs = save_tiny_models(root, models)
    http_port, grpc_port = harness.free_port(), harness.free_port()
    config = harness.loopback_config(dirs["small"], dirs["large"], http_port, grpc_port, replicas=replicas)
    if edit is not None:
        edit(config, dirs)
    apps = [app["name"] for app in config["applications"]]
    env = {**LOCAL_ENV, **(env or {})}
    if direct_ingress:
        env = {**env, **serve_cli.direct_ingress_env(http_port, grpc_port)}
    with contextlib.ExitStack() as stack:
        local = None
        if cluster is not None:
            LOCAL.close()  # one Ray at a time
            patch = stack.enter_context(pytest.MonkeyPatch.context())
            for key, value in env.items():
                patch.setenv(key, value)
            local = cluster()
            stack.callback(local.shutdown)
        else:
            LOCAL.ensure(ray_options, env)
        stack.callback(serve.shutdown)
        deploy(config, root / "config.yaml", *apps)
        yield ServedApp(
            f"http://127.0.0.1:{http_port}",
            f"127.0.0.1:{grpc_port}",
            config,
            root / "config.yaml",
            dirs,
            metrics_url=_local_url(ray_options, "_metrics_export_port"),
            dashboard=_local_url(ray_options, "dashboard_port"),
            cluster=local,
        )


def _local_url(options: Mapping[str, Any], port_option: str) -> str | None:
    return f"http://127.0.0.1:{options[port_option]}" if port_option in options else None


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float, every_s: float = 0.1) -> float:
    """Poll until `predicate()` holds (an AssertionError saying `what` after timeout_s); the
    time.monotonic() at which it held."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(every_s)
    return time.monotonic()


async def stream_noting_first(client, first: asyncio.Future, prompt, **fields) -> list:
    """All deltas of one stream (the HTTP and gRPC clients share `stream`); `first` gets the
    request id as soon as the first delta arrives, so a test can find where it runs."""
    deltas = []
    async for d in client.stream(prompt, **fields):
        deltas.append(d)
        if not first.done():
            first.set_result(d.id)
    return deltas


def in_process_engine(*model_dirs: str) -> BackoffEngine:
    """The in-process engine over saved models (small first, large last): the reference a
    served answer must equal, token for token."""
    loaded = [load_model(d, LoadSpec()) for d in model_dirs]
    models, tokenizer = [model for model, _ in loaded], loaded[0][1]
    return engine_for(models, tokenizer, context_window=512, hidden_size=models[0].config.hidden_size)


async def sse_then_disconnect(base_url: str, body: dict, reads: int = 2) -> int:
    """POST a streamed completion and go away after `reads` reads of its SSE body (a client
    that disconnects mid-stream); the reads made."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            done = 0
            async for _ in response.aiter_raw():
                done += 1
                if done == reads:
                    break
    return done


async def sse_closed_at_first_token(http, body: dict) -> bool:
    """POST a streamed completion (`body` with stream: true) on an httpx.AsyncClient and close
    the connection at its first token; False if it was refused for capacity (503)."""
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code == 503:
            return False
        assert response.status_code == 200, response.status_code
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                return True  # leaving the block closes the connection
    raise AssertionError("the stream ended before its first token")


async def stream_cancelled_at_first_token(client, prompt, **fields) -> bool:
    """Our async client's stream (HTTP or gRPC), its task cancelled after the first token;
    False if it was refused for capacity (OverloadedError) before any token."""
    from clients import OverloadedError

    first = asyncio.Event()

    async def consume():
        async for _ in client.stream(prompt, **fields):
            first.set()

    task, waiter = asyncio.create_task(consume()), asyncio.create_task(first.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not first.is_set():  # over before its first token
        if isinstance(task.exception(), OverloadedError):
            return False
        raise AssertionError(f"a stream ended before its first token: {task.exception()!r}")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return True
