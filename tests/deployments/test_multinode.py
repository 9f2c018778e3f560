"""The Serve application on a Ray cluster of several nodes (tests/support/cluster_local.py: one
machine, separate raylets), tiny models. `pytest -m multinode` runs just these.

Nodes: a head (CPUs: Serve's controller and proxy, the Ingress), two `small_gpu` nodes (one
logical GPU each) and two `large_gpu` nodes (two each). The app asks for them as on a real
cluster: SmallModel replicas need small_gpu + 1 GPU; M_L is split over two tensor-parallel
ranks (`tensor_parallel: {large: 2}`), so a LargeModel replica owns a placement group of two
one-GPU bundles, STRICT_PACK, the first with large_gpu: the replica (rank 0) and its rank
actor on one large_gpu node. Each model replica gets a node of its own. In order: placement
(the ranks' too); a generation whose catch-ups cross nodes, its tokens those of M_L unsplit
in process; the LargeModel's node killed under a stream (its rank with it: re-prefill on the
other replica, a new replica with its rank on a replacement node); a SmallModel's node
killed (its requests fail with a retriable 503, new ones succeed); autoscaling of Ingress and
SmallModel under a burst, recorded (JSON + PNG; BACKOFF_RESULTS=DIR saves them there, e.g.
benchmarks/results). A rank's death is tested on the Serve fakes
(tests/deployments/test_large_tensor_parallel.py) and run with Ray actors by
benchmarks/tensor_parallel_served.py: here it cost a replica's restart.
A tiny KV budget's 503 + Retry-After over HTTP is tested on the deployments' classes without
Ray (tests/deployments/serving/test_kv_budget.py): it needs no cluster, and here it cost a
redeploy of every replica.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams  # noqa: E402
from clients import TransportError  # noqa: E402
from clients.http_client import AsyncBackoffHTTPClient, BackoffHTTPClient  # noqa: E402
from tests.support.cluster_local import LocalCluster, start_cluster  # noqa: E402
from tests.support.served_app import (  # noqa: E402
    ServedApp,
    deploy,
    deployment_config,
    in_process_engine,
    stream_noting_first,
)

pytestmark = [pytest.mark.multinode, pytest.mark.ray]
APP = "backoff"
PROMPT = [4, 5, 6]
THRESHOLD = 0.4  # entropy: a mix of small and large steps on the tiny pair
# every catch-up waits DELAY_MS (LargeModel's inject_delay_ms), so a stream lasts without the
# CPU of its steps: LONG >= 10 s in 100 steps (it was 300 steps at 25 ms: 7.5 s, three times the catch-ups)
DELAY_MS = 100.0
LONG = dict(max_tokens=100, temperature=0, ignore_eos=True, router="always-large")  # >= 10 s
AUTOSCALE = dict(
    min_replicas=1,
    max_replicas=2,
    target_ongoing_requests=2,
    upscale_delay_s=0.5,
    downscale_delay_s=8.0,
    look_back_period_s=3.0,
)  # shorter flaps when a new replica joins
BURST_MAX_S, BURST_TAIL_S = 60.0, 3.0  # the autoscaling test's burst: until both scaled up, then the tail
BURST_TOKENS = 40  # a burst request: >= 4 s (DELAY_MS a catch-up); fewer, longer requests: less CPU per second


def _edit(config: dict, dirs) -> None:
    app = config["applications"][0]
    args = app["args"]
    # autoscaled 2..2 (the last test retunes it live), an Ingress that needs a CPU: the head's
    args["small"].update(num_replicas=None, min_replicas=2, max_replicas=2, gpus="auto", custom_resource="small_gpu")
    args["large"].update(gpus="auto", custom_resource="large_gpu")
    args["models"]["tensor_parallel"] = {"large": 2}  # the tiny M_L's 4 heads / 2 KV heads: 2 and 1 a rank
    args["ingress"].update(num_replicas=None, min_replicas=1, max_replicas=2, num_cpus=0.1)
    args["limits"] = {"max_concurrent_per_client": None}
    # the tests send one prompt again and again and need both SmallModels serving it: affinity
    # (docs/prefix-routing.md) lets it spill over after one request more on its replica, not 8
    args["prefix_routing"] = {"max_imbalance": 1}
    small = deployment_config(config, "SmallModel")
    small["user_config"] = {"router": "entropy", "threshold": [THRESHOLD], "large_timeout_s": 30.0}
    deployment_config(config, "LargeModel")["user_config"].update(lease_s=3.0, inject_delay_ms=DELAY_MS)
    # Serve's autoscaling options (delays, look-back) in the config's `deployments:` section, from
    # the start: the first autoscaling_config there changes the app's code version (a redeploy of
    # every replica), a later change of its numbers is a live update
    small["autoscaling_config"] = {**AUTOSCALE, "min_replicas": 2}
    deployment_config(config, "Ingress")["autoscaling_config"] = AUTOSCALE


@pytest.fixture(scope="module")
def served(serve_app) -> ServedApp:
    """Head, two small_gpu and two large_gpu nodes; the app on them (served.cluster)."""
    cluster = functools.partial(start_cluster, head_cpus=2, gpus={"large_gpu": 2}, small_gpu=2, large_gpu=2)
    return serve_app("multinode", replicas={"small": 2, "large": 2}, edit=_edit, cluster=cluster)


@pytest.fixture(scope="module")
def engine(served):
    return in_process_engine(served.model_dirs["small"], served.model_dirs["large"])


def _reference(engine, router: str, max_tokens: int, thresholds=None):
    return engine.generate(
        GenerationRequest(
            tuple(PROMPT),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            RoutingParams(router=router, thresholds=thresholds),
        )
    )


# -- probes -----------------------------------------------------------------------------------

# Parsing a Serve config with an autoscaling policy (a deploy, serve.status()) registers and then
# unregisters the policy's module for cloudpickle in one global set (ray/serve/config.py,
# AutoscalingPolicy.serialize_policy), so two threads parsing at once can fail with "... is not
# registered for pickle by value" (a full run did, deploying while Recorder polled): this
# module's calls that parse configs take turns.
_PARSING = threading.RLock()


def _infos(deployment: str) -> dict:
    """info() of every live replica of a deployment, by replica id."""

    async def call():
        handle = serve.get_deployment_handle(deployment, APP)
        return await handle.broadcast("info").results_async(timeout_s=30, return_exceptions=True)

    return {i.replica: i for i in asyncio.run(call()) if not isinstance(i, BaseException)}


def _running() -> dict[str, int]:
    """RUNNING replicas per deployment, as Serve's controller sees them."""
    with _PARSING:
        app = serve.status().applications.get(APP)
    if app is None:
        return {}
    return {name: d.replica_states.get("RUNNING", 0) for name, d in app.deployments.items()}


def _wait(check, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s} s (replicas {_running()})")
        time.sleep(0.25)
    return time.monotonic() - start


def _placed(local: LocalCluster, deployment: str, kind: str, n: int) -> bool:
    infos = _infos(deployment)
    nodes = {i.node for i in infos.values()}
    return len(infos) == n and len(nodes) == n and all(local.kind_of(node) == kind for node in nodes)


# -- 1. placement and a generation across nodes -------------------------------------------------


def test_model_replicas_land_on_their_own_node_types(served):
    local = served.cluster
    assert _placed(local, "SmallModel", "small_gpu", 2)  # one per small_gpu node
    assert _placed(local, "LargeModel", "large_gpu", 2)
    routers = {i.node for i in _infos("SmallModel").values()}
    larges = _infos("LargeModel").values()
    assert not routers & {i.node for i in larges} and len(routers | {i.node for i in larges}) == 4
    # M_L over two ranks: each replica's rank 1 is a Ray actor of its own process on its node
    assert all(i.tensor_parallel == 2 and len(i.ranks) == 1 for i in larges)
    assert all(node == i.node and pid != i.pid for i in larges for node, pid in i.ranks)
    gpus = {n["NodeID"]: n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]}
    assert all(gpus[node] == 1 for node in routers) and all(gpus[i.node] == 2 for i in larges)
    # every logical GPU is taken: each model replica, and each rank, reserved a whole one
    assert ray.available_resources().get("GPU", 0) == 0


def test_a_generation_catches_up_across_nodes(served, engine):
    expected = _reference(engine, "entropy", 48, (THRESHOLD,))
    before = sum(i.calls for i in _infos("LargeModel").values())
    with BackoffHTTPClient(served.url) as client:
        out = client.complete(PROMPT, max_tokens=48, temperature=0, ignore_eos=True)
    calls = sum(i.calls for i in _infos("LargeModel").values()) - before
    assert out.token_ids == list(expected.token_ids) and out.sources == list(expected.sources)
    assert 0 < out.usage.small_tokens < 48 and out.usage.large_tokens > 0
    # catch-ups went from a small_gpu node to a large_gpu node, several pending tokens at once
    assert calls == out.usage.large_calls == len(expected.catch_ups)
    assert max(c.length for c in expected.catch_ups[1:]) > 1


# -- 2. losing nodes ------------------------------------------------------------------------------


def test_losing_the_large_models_node_mid_stream(served, engine):
    """The node holding the request's M_L session dies: the router re-prefills the session
    on the other LargeModel replica and the stream completes with the same tokens; Serve
    places a new replica on a replacement node."""
    local = served.cluster
    reference = list(_reference(engine, "always-large", LONG["max_tokens"]).token_ids)
    with BackoffHTTPClient(served.url) as client:
        stream = client.stream(PROMPT, **LONG)
        deltas = [next(stream) for _ in range(5)]
        holders = [i for i in _infos("LargeModel").values() if i.sessions]
        assert len(holders) == 1, holders
        lost_node = holders[0].node
        assert local.kill(lost_node) == "large_gpu"
        killed = time.monotonic()
        deltas += list(stream)
        finished_s = time.monotonic() - killed
    tokens = [d.token_id for d in deltas if d.finish_reason is None]
    assert deltas[-1].finish_reason == "length" and tokens == reference
    lost = sum(i.sessions_lost for i in _infos("SmallModel").values())
    assert lost >= 1
    new_node = local.add("large_gpu").node_id  # the cluster's autoscaler would start one
    up_s = _wait(
        lambda: (
            _placed(local, "LargeModel", "large_gpu", 2) and new_node in {i.node for i in _infos("LargeModel").values()}
        ),
        120,
        "a LargeModel replica",
    )
    print(
        f"\nlarge node killed: the stream finished {finished_s:.1f} s later; a new replica was up on the "
        f"replacement node {up_s:.1f} s after it joined"
    )


def test_losing_a_small_routers_node(served, engine):
    """Requests on the lost SmallModel end with a retriable error (SSE: an in-band 503
    error event, `router_unavailable`); those on the other finish whole; new requests
    succeed while the deployment has one replica left."""
    local = served.cluster
    reference = list(_reference(engine, "always-large", LONG["max_tokens"]).token_ids)

    async def main():
        async with AsyncBackoffHTTPClient(served.url) as client:
            flights = {}  # request id -> (task, router node)
            for _ in range(12):  # until both routers serve some (where one lands is Serve's choice)
                first = asyncio.get_running_loop().create_future()
                task = asyncio.create_task(stream_noting_first(client, first, PROMPT, **LONG))
                request_id = await asyncio.wait_for(first, 60)
                where = {
                    r: i.node for i in (await asyncio.to_thread(_infos, "SmallModel")).values() for r in i.requests
                }
                flights[request_id] = (task, where[request_id])
                if len({node for _, node in flights.values()}) == 2 and len(flights) >= 4:
                    break
            nodes = sorted({node for _, node in flights.values()})
            assert len(nodes) == 2, "all requests went to one router"
            victim = nodes[0]
            assert all(not t.done() for t, _ in flights.values())
            assert await asyncio.to_thread(local.kill, victim) == "small_gpu"
            outcomes = await asyncio.gather(*[t for t, _ in flights.values()], return_exceptions=True)
            return [(node == victim, out) for (_, node), out in zip(flights.values(), outcomes)]

    results = asyncio.run(main())
    for doomed, out in results:
        if doomed:
            assert isinstance(out, TransportError) and out.status == 503 and "small router" in out.message, out
        else:
            assert not isinstance(out, BaseException), out
            assert [d.token_id for d in out if d.finish_reason is None] == reference
    assert any(doomed for doomed, _ in results) and not all(doomed for doomed, _ in results)
    _wait(lambda: len(_infos("SmallModel")) == 1, 60, "the dead router dropped")
    with BackoffHTTPClient(served.url) as client:  # new requests: the surviving router
        for i in range(4):
            out = client.complete([3 + i, 4], max_tokens=8, temperature=0, ignore_eos=True)
            assert len(out.token_ids) == 8
    local.add("small_gpu")  # room again for the autoscaling test
    _wait(lambda: _placed(local, "SmallModel", "small_gpu", 2), 120, "a replacement SmallModel")


# -- 3. autoscaling ---------------------------------------------------------------------------------


class Recorder:
    """Replica counts per deployment every `period_s`, from Serve's controller."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s, self.samples, self.marks = period_s, [], {}
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                counts = _running()
            except Exception:  # noqa: BLE001 - the controller busy: skip a sample
                counts = None
            if counts:
                self.samples.append({"t": round(time.monotonic() - self.t0, 2), **counts})
            self._stop.wait(self.period_s)

    def mark(self, name: str) -> None:
        self.marks[name] = round(time.monotonic() - self.t0, 2)

    def __enter__(self) -> "Recorder":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def series(self, name: str) -> list[int]:
        return [s.get(name, 0) for s in self.samples]

    def save(self, directory: Path, meta: dict) -> tuple[Path, Path]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        directory.mkdir(parents=True, exist_ok=True)
        data = {"meta": meta, "marks": self.marks, "samples": self.samples}
        path_json = directory / "autoscaling.json"
        path_json.write_text(json.dumps(data, indent=1))
        names = ("Ingress", "SmallModel", "LargeModel")
        fig, axes = plt.subplots(len(names), 1, figsize=(8, 5), sharex=True)
        t = [s["t"] for s in self.samples]
        for ax, name, color in zip(axes, names, ("C0", "C1", "C2")):
            ax.step(t, self.series(name), where="post", color=color)
            ax.set_ylim(-0.2, 2.6)
            ax.set_yticks([0, 1, 2])
            ax.set_ylabel(name, fontsize=9)
            for mark, at in self.marks.items():
                ax.axvline(at, color="grey", linestyle=":")
                if ax is axes[0]:
                    ax.text(at, 2.5, f" {mark}", fontsize=8, va="top")
        axes[-1].set_xlabel("seconds")
        axes[0].set_title(
            f"RUNNING replicas under a burst of {meta.get('streams')} concurrent requests "
            f"(multi-node Ray cluster on one machine)",
            fontsize=10,
        )
        fig.tight_layout()
        path_png = directory / "autoscaling.png"
        fig.savefig(path_png, dpi=110)
        plt.close(fig)
        return path_json, path_png


def test_autoscaling_follows_a_burst(served, tmp_path):
    """SmallModel (1..2) and Ingress (1..2), target 2 ongoing requests each: a burst of 12
    concurrent requests scales both up, and they scale down after it. The SmallModel's
    lower bound goes from 2 to 1 live (the config's `deployments:` section): no replica restarts.
    The burst lasts until both have run two replicas (then BURST_TAIL_S more), at most
    BURST_MAX_S: a fixed 40 s was mostly spent after both had scaled."""
    app = served.config["applications"][0]
    for d in app["deployments"]:
        if d["name"] == "SmallModel":
            d["autoscaling_config"] = AUTOSCALE
    streams = 12
    larges = {i.pid for i in _infos("LargeModel").values()}
    with Recorder() as rec:
        with _PARSING:  # Recorder's polls wait (the deploy's own wait until running included)
            deploy(served.config, served.config_path.with_name("autoscale.yaml"), APP)
        _wait(lambda: _running().get("SmallModel") == 1 and _running().get("Ingress") == 1, 120, "scaled to 1")
        rec.mark("burst")

        refused = 0

        def scaled_up() -> bool:
            seen = [s for s in rec.samples if s["t"] >= rec.marks["burst"]]
            return all(any(s.get(name, 0) == 2 for s in seen) for name in ("SmallModel", "Ingress"))

        async def burst() -> int:
            done = 0
            deadline = time.monotonic() + BURST_MAX_S

            async def until_scaled() -> None:
                nonlocal deadline
                while time.monotonic() < deadline and not scaled_up():
                    await asyncio.sleep(0.25)
                deadline = min(deadline, time.monotonic() + BURST_TAIL_S)

            async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:

                async def worker(i: int) -> None:
                    nonlocal done, refused
                    while time.monotonic() < deadline:
                        r = await http.post(
                            "/v1/completions",
                            json={
                                "prompt": [3 + i % 7, 4],
                                "max_tokens": BURST_TOKENS,
                                "temperature": 0,
                                "ignore_eos": True,
                                "router": "always-large",
                            },
                        )
                        assert r.status_code in (200, 503), r.text
                        done += r.status_code == 200
                        refused += r.status_code == 503

                await asyncio.gather(until_scaled(), *[worker(i) for i in range(streams)])
            return done

        completed = asyncio.run(burst())
        rec.mark("end of burst")
        _wait(lambda: _running().get("SmallModel") == 1 and _running().get("Ingress") == 1, 120, "scaled down")
        time.sleep(1.0)
        rec.mark("scaled down")
    during = [s for s in rec.samples if rec.marks["burst"] <= s["t"] <= rec.marks["end of burst"]]
    meta = {
        "streams": streams,
        "burst_s": round(rec.marks["end of burst"] - rec.marks["burst"], 1),
        "completed": completed,
        "refused": refused,
        "request": f"{BURST_TOKENS} tokens, always-large, {DELAY_MS:g} ms delay per catch-up",
        "autoscaling_config": AUTOSCALE,
        "nodes": {"head": "2 CPUs", "small_gpu": 2, "large_gpu": 2},
    }
    out = Path(os.environ.get("BACKOFF_RESULTS", tmp_path))
    paths = rec.save(out, meta)
    print(f"\nautoscaling: {completed} requests in the burst ({refused} refused); saved {paths[0]} and {paths[1]}")
    assert completed > 0 and {i.pid for i in _infos("LargeModel").values()} == larges  # a live update
    assert max(s.get("SmallModel", 0) for s in during) == 2 and max(s.get("Ingress", 0) for s in during) == 2
    assert rec.series("SmallModel")[-1] == 1 and rec.series("Ingress")[-1] == 1
