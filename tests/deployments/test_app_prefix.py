"""Prefix-aware routing (deployments/prefix_routing.py) on a real local Ray Serve app: the tiny
pair, two SmallModel replicas, requests over HTTP. Where a request ran is read back from the
replicas' info().recent (request ids). `max_imbalance` is 2 here, so a burst of a dozen
requests is load enough to spill a hot prefix over. The replica-kill test runs last.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from tests.support.served_app import ServedApp, wait_until  # noqa: E402

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)
MAX_IMBALANCE = 2


def _edit(config: dict, dirs) -> None:
    config["applications"][0]["args"]["prefix_routing"] = {"enabled": True, "max_imbalance": MAX_IMBALANCE}


@pytest.fixture(scope="module")
def served(serve_app) -> ServedApp:
    return serve_app("prefix", replicas={"small": 2}, edit=_edit)


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(2, 48)}" for _ in range(n))


async def _infos() -> dict:
    """info() of every live SmallModel replica, by replica id."""
    handle = serve.get_deployment_handle("SmallModel", "backoff")
    infos = await handle.broadcast("info").results_async(timeout_s=30, return_exceptions=True)
    return {i.replica: i for i in infos if not isinstance(i, BaseException)}


async def _where(ids: list[str]) -> dict[str, str]:
    """request id -> the replica that served it."""
    found = {rid: replica for replica, info in (await _infos()).items() for rid in info.recent}
    return {rid: found[rid] for rid in ids}


async def _complete(http: httpx.AsyncClient, body: dict, chat: bool = False) -> str:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = await http.post(path, json={"max_tokens": 2, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _bodies(prefix_seed: int, n: int) -> list[tuple[dict, bool]]:
    """n requests sharing a long prefix: text, chat (same system prompt) or token ids by seed."""
    prefix, form = _words(prefix_seed, 60), prefix_seed % 3
    tails = [_words(1000 * prefix_seed + i, 4) for i in range(n)]
    if form == 0:
        return [({"prompt": f"{prefix} {t}"}, False) for t in tails]
    if form == 1:
        return [
            ({"messages": [{"role": "system", "content": prefix}, {"role": "user", "content": t}]}, True) for t in tails
        ]
    ids = [int(w[1:]) for w in prefix.split()]
    return [({"prompt": ids + [int(w[1:]) for w in t.split()]}, False) for t in tails]


def test_shared_prefix_goes_to_one_replica_and_prefixes_spread(served):
    async def run() -> dict[int, set[str]]:
        placed: dict[int, set[str]] = {}
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            for seed in range(6):  # text, chat, ids, twice
                ids = [await _complete(http, body, chat) for body, chat in _bodies(seed, 3)]
                placed[seed] = set((await _where(ids)).values())
        return placed

    placed = asyncio.run(run())
    assert all(len(replicas) == 1 for replicas in placed.values()), f"a prefix split over replicas: {placed}"
    used = set().union(*placed.values())
    assert len(used) == 2, f"6 prefixes all went to one replica: {placed}"


def test_a_batch_reaches_the_replicas_prompt_by_prompt(served):
    """A batch's requests share the HTTP request's internal id: each must still be routed (a
    router without Serve's FIFO matching left all but one waiting in the Ingress)."""
    batch = [f"{_words(90 + i % 2, 60)} {_words(i, 3)}" for i in range(4)]
    response = httpx.post(f"{served.url}/v1/completions", json={"prompt": batch, "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2, 3]


def test_hot_prefix_spills_over_to_the_other_replica(served):
    """A dozen long requests of one prefix at once (well, 20 ms apart): its replica takes up to
    MAX_IMBALANCE more than the other, the rest go elsewhere."""

    async def run() -> tuple[str, dict[str, str]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:
            bodies = _bodies(30, 13)
            first = await _complete(http, bodies[0][0])  # the prefix gets its replica
            home = (await _where([first]))[first]
            long = {"max_tokens": 96, "ignore_eos": True}

            async def later(i: int, body: dict) -> str:  # 20 ms apart: each routing sees the load before it
                await asyncio.sleep(0.02 * i)
                return await _complete(http, {**body, **long})

            ids = await asyncio.gather(*(later(i, body) for i, (body, _) in enumerate(bodies[1:])))
            return home, await _where(list(ids))

    home, where = asyncio.run(run())
    away = [rid for rid, replica in where.items() if replica != home]
    assert away, f"all 12 requests of the hot prefix queued on its replica {home}"
    assert len(where) - len(away) > MAX_IMBALANCE, f"affinity did not hold under light load: {len(away)} of 12 away"


def test_replica_going_away_leaves_routing_working(served):
    """Kill the replica holding a prefix: its next requests are served (by the other replica,
    or by the one Serve starts instead), and the dead replica leaves the prefix tree."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:
            bodies = _bodies(60, 7)
            first = await _complete(http, bodies[0][0])
            infos = await _infos()
            victim = (await _where([first]))[first]
            os.kill(infos[victim].pid, signal.SIGKILL)
            ids = []
            for body, _ in bodies[1:]:
                ids.append(await _complete(http, body))  # each a 200
            where = await _where(ids)
            assert victim not in where.values()

    asyncio.run(run())
    tree = ray.get_actor("LlmPrefixTreeActor", namespace="serve::backoff::SmallModel")
    live = set(asyncio.run(_infos()))

    def tenants_live() -> bool:
        tenants = {t.split("#")[-1] for t in ray.get(tree.getattr.remote("tenant_to_char_count"))}
        return tenants <= live

    wait_until(tenants_live, "the killed replica is still a tenant of the prefix tree", 30.0)
