"""The Serve application end to end, changed while it serves (tiny models, a local CPU Ray
cluster; what it shares with test_app_e2e.py: tests/support/e2e_app.py): a live config change
with the threshold (`backoff serve` again) and with a fault injected into the step loop, and
a LargeModel replica killed mid-generation. It runs on test_app_e2e.py's app, after all of
that module's tests and test_app_load.py's (SHARED_APP), so no other module's tests see the
changes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

pytest.importorskip("ray")

from clients import ServerError  # noqa: E402
from clients.grpc_client import AsyncBackoffGrpcClient  # noqa: E402
from clients.http_client import AsyncBackoffHTTPClient, BackoffHTTPClient  # noqa: E402
from deployments import harness  # noqa: E402
from tests.support import e2e_app  # noqa: E402
from tests.support.e2e_app import THRESHOLD, large_infos, reference, router_info  # noqa: E402
from tests.support.served_app import ServedApp, deploy, deployment_config  # noqa: E402

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)
SHARED_APP = e2e_app.SHARED_KEY  # test_app_e2e.py's app: deployed once for both modules


@pytest.fixture(scope="module")
def served(shared_app) -> ServedApp:
    """Ingress, SmallModel (entropy at THRESHOLD) and two LargeModel replicas (and the chain)."""
    return shared_app(SHARED_APP, e2e_app.start_with_chain)


@pytest.fixture(scope="module")
def local(served):
    return e2e_app.local_engine(served)


def _router_config(served: ServedApp, **changes) -> None:
    """`backoff serve` of the config with these SmallModel user_config changes (live)."""
    edited = json.loads(json.dumps(served.config))
    deployment_config(edited, "SmallModel")["user_config"].update(changes)
    deploy(edited, served.config_path.with_name("router.yaml"))
    deadline = time.monotonic() + 60
    while not router_info().policy.model_dump().items() >= changes.items():
        assert time.monotonic() < deadline, "reconfigure did not arrive"
        time.sleep(0.2)
    harness.wait_until_running("backoff")


def test_a_request_failing_in_the_step_loop_ends_alone_beside_live_streams(served, local):
    """Requests with the chaos seed (routing.inject_fault_seed) fail inside the step loop --
    their M_S forward, batched with two live streams (HTTP and gRPC), raises after writing
    every cache -- over HTTP unary (500 + OpenAI body), SSE (in-band error, [DONE]) and gRPC
    (INTERNAL). The streams carry on: all their tokens, the in-process ones, a normal finish."""
    bad_seed, n, prompts = 4242, 200, ([3, 4, 5, 6], [7, 8, 9])
    _router_config(served, inject_fault_seed=bad_seed)

    async def main():
        async with (
            AsyncBackoffHTTPClient(served.url) as http,
            httpx.AsyncClient(base_url=served.url, timeout=60) as raw,
            AsyncBackoffGrpcClient(served.grpc_target, application="backoff") as rpc,
        ):
            started = [asyncio.Event(), asyncio.Event()]

            async def live(client, prompt, first):
                deltas = []
                async for d in client.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True):
                    deltas.append(d)
                    first.set()
                return deltas

            streams = [asyncio.create_task(live(c, p, e)) for c, p, e in zip((http, rpc), prompts, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            bad = {"prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "seed": bad_seed}

            async def grpc_stream():
                try:
                    return [d async for d in rpc.stream(**bad)]
                except ServerError as exc:
                    return exc

            failed = await asyncio.gather(
                raw.post("/v1/completions", json=bad),
                raw.post("/v1/completions", json={**bad, "stream": True}),
                grpc_stream(),
            )
            alive = [not t.done() for t in streams]  # the failures happened beside them
            return await asyncio.gather(*streams), failed, alive

    try:
        outs, (unary, sse, grpc_failure), alive = asyncio.run(main())
    finally:
        _router_config(served, inject_fault_seed=None)
    says, hidden = "the server failed while handling this request (request cmpl-", "InjectedFault"  # detail: the log's
    assert unary.status_code == 500 and unary.headers["content-type"] == "application/json", unary.text
    assert says in unary.json()["error"]["message"] and unary.json()["error"]["type"] == "server_error"
    events = [line[len("data: ") :] for line in sse.text.splitlines() if line.startswith("data: ")]
    assert sse.status_code == 200 and events[-1] == "[DONE]" and says in json.loads(events[-2])["error"]["message"]
    assert isinstance(grpc_failure, ServerError) and grpc_failure.status == "INTERNAL" and says in grpc_failure.message
    assert hidden not in unary.text + sse.text + grpc_failure.message
    assert alive == [True, True]
    for prompt, deltas in zip(prompts, outs):
        ref = reference(local, prompt, n)
        assert [d.token_id for d in deltas if d.token_id is not None] == list(ref.token_ids)
        assert [d.source for d in deltas if d.token_id is not None] == list(ref.sources)
        assert deltas[-1].finish_reason == "length"
    deadline = time.monotonic() + 30  # every session freed: the failed ones' too
    while router_info().live or any(i.sessions for i in large_infos().values()):
        assert time.monotonic() < deadline, "sessions left behind"
        time.sleep(0.2)


def _backoff_rate(url: str, n: int = 6) -> float:
    with BackoffHTTPClient(url) as client:
        outs = [client.complete([3 + i, 7, 11], max_tokens=16, temperature=0, ignore_eos=True) for i in range(n)]
    return sum(o.usage.small_tokens for o in outs) / sum(o.usage.completion_tokens for o in outs)


def test_config_deploy_changes_the_threshold_live(served):
    router_before, large_before = router_info(), {i.replica: i.pid for i in large_infos().values()}
    low = _backoff_rate(served.url)
    edited = json.loads(json.dumps(served.config))
    deployment_config(edited, "SmallModel")["user_config"]["threshold"] = [50.0]  # nothing is that uncertain: all small
    deploy(edited, served.config_path.with_name("edited.yaml"))
    deadline = time.monotonic() + 60
    while router_info().policy.thresholds != [50.0]:
        assert time.monotonic() < deadline, "reconfigure did not arrive"
        time.sleep(0.2)
    harness.wait_until_running("backoff")
    high = _backoff_rate(served.url)
    assert low < 0.9 and high == 1.0
    with BackoffHTTPClient(served.url) as client:  # a request may still override the config
        own = client.complete([3, 7, 11], max_tokens=16, temperature=0, ignore_eos=True, backoff_threshold=THRESHOLD)
    assert own.usage.backoff_rate < 1.0
    router_after = router_info()
    assert (router_after.pid, router_after.replica) == (router_before.pid, router_before.replica)
    assert {i.replica: i.pid for i in large_infos().values()} == large_before


def test_killed_large_replica_mid_generation_still_completes(served, local):
    prompt, n = [4, 5, 6], 300
    before = router_info().sessions_lost
    with BackoffHTTPClient(served.url) as client:
        stream = client.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True, router="always-large")
        deltas = [next(stream) for _ in range(5)]
        holders = [i for i in large_infos().values() if i.sessions]
        assert len(holders) == 1, holders
        os.kill(holders[0].pid, signal.SIGKILL)  # the replica holding the session crashes
        deltas += list(stream)
    tokens = [d.token_id for d in deltas if d.token_id is not None]
    assert deltas[-1].finish_reason == "length" and len(tokens) == n
    ref = reference(local, prompt, n, router="always-large", thresholds=None)
    assert tokens == list(ref.token_ids)  # re-prefilled elsewhere: the same text
    assert router_info().sessions_lost > before
    harness.wait_until_running("backoff")
