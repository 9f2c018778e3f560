"""Stand-ins for what Ray Serve gives a replica, so that the deployment classes of
deployments/ (their `.func_or_class`) run in the test process with Ray not started:

- `replica_context`: the replica's id and node (serve.get_replica_context, ray.get_runtime_context);
- `LoopThread` (from tests/support/remote_fakes.py): the larger replicas' event loop, on a thread;
- `Multiplexer`: `@serve.multiplexed` of one LargeModel (an LRU of what `_register` returned;
  the real one needs a live replica and pushes its ids to the controller);
- `FakeHandle`: a DeploymentHandle of a LargeModel deployment over such instances: calls routed
  by multiplexed_model_id (whose value the replica reads from Serve's request context, set here
  as Serve sets it), `broadcast(...).results_async` for the lease renewals;
- `SmallHandle`, `ingress_replica`, `serving`: the Ingress over a SmallModel instance, its FastAPI
  app served by uvicorn on a loopback port on a thread (real HTTP, real SSE), for the official
  `openai` client; `serve_status`: what Serve's controller says of the app (serve.status()).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import inspect
import socket
import threading
import time
import types
from collections.abc import Iterator

import ray
from ray import serve
from ray.serve.context import _set_request_context

from tests.support.remote_fakes import LoopThread


def replica_context(monkeypatch, replica: str = "small-replica-0", node: str = "node-0", servable=None) -> None:
    """What a replica asks Serve and Ray about itself, answered without a cluster (servable:
    the instance a FastAPI route's `self` is, as Serve finds it)."""
    context = types.SimpleNamespace(
        replica_id=types.SimpleNamespace(unique_id=replica),
        deployment="test",
        app_name="test",
        servable_object=servable,
    )
    runtime = types.SimpleNamespace(get_node_id=lambda: node, get_assigned_resources=lambda: {})
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: runtime)


class Multiplexer:
    """`@serve.multiplexed(max_num_models_per_replica=capacity)` on `large._register`: the
    undecorated loader's results, least recently used dropped beyond `capacity` (dropping
    the last reference is what frees a session in Serve too)."""

    def __init__(self, large, capacity: int = 4096) -> None:
        self.large, self.capacity = large, capacity
        self.loader = type(large)._register.__wrapped__  # the method under Serve's decorator
        self.held: collections.OrderedDict[str, object] = collections.OrderedDict()
        self.loads: list[str] = []

    async def __call__(self, key: str):
        if key in self.held:
            self.held.move_to_end(key)
            return self.held[key]
        self.loads.append(key)
        self.held[key] = await self.loader(self.large, key)
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)
        return self.held[key]

    def evict(self, key: str) -> None:
        del self.held[key]


class _Pending:
    """A DeploymentResponse: `.result(timeout_s)` blocks the calling thread."""

    def __init__(self, future) -> None:
        self.future = future

    def result(self, timeout_s: float | None = None):
        return self.future.result(timeout_s)


class _Method:
    def __init__(self, handle: "FakeHandle", name: str, key: str) -> None:
        self.handle, self.name, self.key = handle, name, key

    def remote(self, *args) -> _Pending:
        replica = self.handle.route(self.key)
        self.handle.sent.append((self.name, self.key, replica))

        async def call():
            _set_request_context(multiplexed_model_id=self.key)  # this task's context, as in a replica
            return await getattr(self.handle.replicas[replica], self.name)(*args)

        return _Pending(asyncio.run_coroutine_threadsafe(call(), self.handle.lt.loop))


class _Keyed:
    def __init__(self, handle: "FakeHandle", key: str) -> None:
        self.handle, self.key = handle, key

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.handle, name, self.key)


class _Broadcast:
    def __init__(self, handle: "FakeHandle", name: str, args: tuple) -> None:
        self.handle, self.name, self.args = handle, name, args

    async def results_async(self, timeout_s: float | None = None, return_exceptions: bool = False) -> list:
        futures = [
            asyncio.run_coroutine_threadsafe(getattr(r, self.name)(*self.args), self.handle.lt.loop)
            for r in self.handle.replicas
        ]

        def results() -> list:
            out = []
            for future in futures:
                try:
                    out.append(future.result(timeout_s))
                except Exception as exc:  # noqa: BLE001 - as Serve's return_exceptions
                    if not return_exceptions:
                        raise
                    out.append(exc)
            return out

        # waited for on a thread: a caller cancelled meanwhile (its loop closing) is not held up
        return await asyncio.get_running_loop().run_in_executor(None, results)


class FakeHandle:
    """A LargeModel deployment's handle over `replicas` (user-class instances) on `lt`'s loop.
    `sent` records (method, key, replica index) of every keyed call."""

    def __init__(self, replicas: list, lt: LoopThread) -> None:
        self.replicas, self.lt = replicas, lt
        self.sent: list[tuple[str, str, int]] = []
        self.broadcasts: list[tuple[str, tuple]] = []

    def options(self, multiplexed_model_id: str | None = None, **_options):
        return self if multiplexed_model_id is None else _Keyed(self, multiplexed_model_id)

    def route(self, key: str) -> int:
        """Session affinity: one replica per key (highest random weight)."""
        return max(range(len(self.replicas)), key=lambda i: hashlib.sha1(f"{key}{i}".encode()).digest())

    def broadcast(self, name: str, *args) -> _Broadcast:
        self.broadcasts.append((name, args))
        return _Broadcast(self, name, args)


def large_replica(monkeypatch, model, level: int = 1, models: dict | None = None, capacity: int = 4096):
    """A LargeModel instance serving `model` (its loading replaced), its multiplexer faked."""
    from deployments import large
    from deployments.serving import models as loading  # the replica imports its loader when it starts

    replica_context(monkeypatch)
    monkeypatch.setattr(loading, "load_level", lambda cfg, lvl, threads=None, host=False: model)
    replica = large.LargeModel.func_or_class(models or {}, level)
    replica._register = Multiplexer(replica, capacity)
    return replica


def small_replica(monkeypatch, model, tokenizer, handles: list, args: dict | None = None):
    """A SmallModel instance over `model` and the larger deployments' `handles`, its engine
    thread started (stop it: `.loop.stop()`)."""
    import sys

    from deployments import small
    from deployments.serving import models as loading  # the replica imports its loader when it starts

    replica_context(monkeypatch)
    side = loading.SmallSide(model, tokenizer, model.config.max_position_embeddings, model.config.hidden_size)
    monkeypatch.setattr(loading, "load_small_side", lambda cfg, threads=None: side)
    monkeypatch.setattr(sys, "setswitchinterval", lambda s: None)  # a replica's setting, not the test process's
    return small.SmallModel.func_or_class(args or {}, *handles)


class _Stream:
    """A DeploymentResponseGenerator over a replica's async generator: `cancel()` closes it."""

    def __init__(self, items) -> None:
        self.items = items

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self.items)

    def cancel(self) -> None:
        asyncio.get_running_loop().create_task(self.items.aclose())


class _Call:
    def __init__(self, method, stream: bool) -> None:
        self.method, self.stream = method, stream

    def remote(self, *args):
        if self.stream:
            return _Stream(self.method(*args))

        async def call():
            out = self.method(*args)
            return await out if inspect.isawaitable(out) else out

        return call()


class SmallHandle:
    """A SmallModel deployment's handle over one user-class instance, as the Ingress calls it:
    `generate.remote(request, tokens)` a stream, any other method's `.remote()` awaited,
    `broadcast(name).results_async()` its one replica's answer."""

    def __init__(self, small) -> None:
        self.small = small
        self.generate = _Call(small.generate, True)

    def __getattr__(self, name: str) -> _Call:
        return _Call(getattr(self.small, name), False)

    def options(self, **_options) -> SmallHandle:
        return self

    def broadcast(self, name: str, *args) -> _OneReplica:
        return _OneReplica(getattr(self, name).remote(*args))


class _OneReplica:
    """A broadcast's results over one replica."""

    def __init__(self, reply) -> None:
        self.reply = reply

    async def results_async(self, timeout_s: float | None = None, return_exceptions: bool = False) -> list:
        try:
            return [await asyncio.wait_for(self.reply, timeout_s)]
        except Exception as exc:  # noqa: BLE001 - as Serve's return_exceptions
            if not return_exceptions:
                raise
            return [exc]


def serve_status(app: str = "test", starting: tuple[str, ...] = ()) -> types.SimpleNamespace:
    """`serve.status()` of an app whose Ingress, SmallModel and LargeModel run one replica each,
    but the `starting` deployments, which have none running yet (schema.ServeStatus's shape)."""

    def deployment(name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(replica_states={"STARTING" if name in starting else "RUNNING": 1})

    deployments = {name: deployment(name) for name in ("Ingress", "SmallModel", "LargeModel")}
    overview = types.SimpleNamespace(status="DEPLOYING" if starting else "RUNNING", message="", deployments=deployments)
    return types.SimpleNamespace(applications={app: overview}, proxies={"node-0": "HEALTHY"})


def ingress_replica(monkeypatch, small, args: dict | None = None):
    """An Ingress instance (the class @serve.ingress wrapped, built as Serve builds it, less its
    ASGI wrapper) over a SmallModel instance; the FastAPI routes find it as their `self`, and
    Serve's controller says every replica of the app runs (`serve_status`)."""
    from deployments import ingress

    wrapper = ingress.Ingress.func_or_class

    class Bare(wrapper):
        def __del__(self) -> None:  # no ASGI app of Serve's to shut down
            pass

    replica = object.__new__(Bare)
    wrapper.__mro__[1].__init__(replica, SmallHandle(small), args or {})
    replica_context(monkeypatch, servable=replica)
    monkeypatch.setattr(serve, "status", serve_status)
    return replica


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """`app` served by uvicorn on a free loopback port, on a thread; yields its base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
