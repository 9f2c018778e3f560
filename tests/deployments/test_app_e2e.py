"""The Serve application end to end on a real (local, CPU) Ray cluster with tiny models.

One application for the whole module, deployed the way `backoff serve` / `serve run`
deploy it (the packaged config with overrides): Ingress, one SmallModel, TWO LargeModel
replicas (every test goes through session affinity), beside a chain of three (whose tiny
limits are test_app_load.py's; tests/support/e2e_app.py). The tests that change the live config
or kill a replica are test_app_load.py's and test_app_e2e_live.py's, which run next on the
same app (SHARED_APP): no test here sees them.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import grpc
import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams  # noqa: E402
from clients import BadRequestError, NotFoundError  # noqa: E402
from clients.grpc_client import AsyncBackoffGrpcClient, BackoffGrpcClient  # noqa: E402
from clients.http_client import AsyncBackoffHTTPClient, BackoffHTTPClient  # noqa: E402
from clients.wire import backoff_pb2 as pb  # noqa: E402
from clients.wire import backoff_pb2_grpc as pb_grpc  # noqa: E402
from deployments import serve_cli  # noqa: E402
from tests.support import e2e_app  # noqa: E402
from tests.support.e2e_app import THRESHOLD, large_infos, reference, router_info  # noqa: E402
from tests.support.playground_page import PlaygroundPage, browser_missing  # noqa: E402
from tests.support.served_app import ServedApp, in_process_engine  # noqa: E402

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)
SHARED_APP = e2e_app.SHARED_KEY  # the app of test_app_e2e*.py and test_app_load.py, deployed once
CHAIN_THRESHOLDS = e2e_app.CHAIN_THRESHOLDS
APP = (("application", "backoff"),)  # gRPC: which of the two applications


@pytest.fixture(scope="module")
def served(shared_app) -> ServedApp:
    """Ingress, SmallModel and two LargeModel replicas (`backoff`), the chain (`chain`)."""
    return shared_app(SHARED_APP, e2e_app.start_with_chain)


@pytest.fixture(scope="module")
def local(served):
    return e2e_app.local_engine(served)


# -- end to end ---------------------------------------------------------------------------


def test_http_unary_and_stream(served, local):
    with BackoffHTTPClient(served.url) as client:
        unary = client.complete([3, 4, 5, 6], max_tokens=20, temperature=0, ignore_eos=True)
        deltas = list(client.stream([3, 4, 5, 6], max_tokens=20, temperature=0, ignore_eos=True))
        assert client.models() == ["backoff"] and client.health()
    tokens = [d for d in deltas if d.token_id is not None]
    assert [d.token_id for d in tokens] == unary.token_ids and [d.source for d in tokens] == unary.sources
    assert "".join(d.text for d in deltas) == unary.text
    usage = deltas[-1].usage
    assert deltas[-1].finish_reason == "length" and usage == unary.usage
    assert usage.small_tokens + usage.large_tokens == usage.completion_tokens == 20
    assert 0 < usage.small_tokens < 20 and usage.large_calls >= 1
    ref = reference(local, [3, 4, 5, 6], 20)
    assert (unary.token_ids, unary.sources) == (list(ref.token_ids), list(ref.sources))


def test_a_local_ray_gives_serve_a_patient_proxy_ready_check(served):
    """Serve's processes (workers of the local Ray) see serve_cli.LOCAL_SERVE_ENV."""

    @ray.remote(num_cpus=0)
    def environment(keys):
        return {k: os.environ.get(k) for k in keys}

    assert ray.get(environment.remote(list(serve_cli.LOCAL_SERVE_ENV)), timeout=60) == serve_cli.LOCAL_SERVE_ENV


def test_served_output_equals_in_process(served, local):
    cases = [  # (prompt, fields, reference kwargs)
        ([5, 9, 13, 2], dict(temperature=0.9, seed=7), dict(temperature=0.9, seed=7)),
        ([7, 8], dict(temperature=0, backoff_threshold=0.8), dict(thresholds=(0.8,))),
        (
            [11, 12, 13],
            dict(temperature=0.7, seed=3, router="always-large"),
            dict(temperature=0.7, seed=3, router="always-large", thresholds=None),
        ),
    ]
    with BackoffHTTPClient(served.url) as http, BackoffGrpcClient(served.grpc_target, application="backoff") as rpc:
        for prompt, fields, ref_kwargs in cases:
            ref = reference(local, prompt, 24, **ref_kwargs)
            for client in (http, rpc):
                out = client.complete(prompt, max_tokens=24, ignore_eos=True, **fields)
                assert (out.token_ids, out.sources) == (list(ref.token_ids), list(ref.sources)), type(client)
                assert out.usage.large_calls == ref.large_calls


def test_concurrent_requests_share_steps_and_match_in_process(served, local):
    prompts = [[3 + i, 4 + i, 5] for i in range(6)]
    before = router_info().steps

    async def run():
        async with AsyncBackoffHTTPClient(served.url) as http:
            return await asyncio.gather(
                *[
                    http.complete(
                        p, max_tokens=16, temperature=0, ignore_eos=True, seed=i, router="random", backoff_threshold=0.5
                    )
                    for i, p in enumerate(prompts)
                ]
            )

    outs = asyncio.run(run())
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = reference(local, p, 16, router="random", thresholds=(0.5,), seed=i)
        assert (out.token_ids, out.sources) == (list(ref.token_ids), list(ref.sources))
    assert router_info().steps - before < 6 * 16  # M_S steps of concurrent requests were batched


def test_every_replica_froze_its_startup_heap(served):
    # Ray Serve froze what each replica's process loaded once its __init__ returned
    # (engine/gc_heap.py), so that a full collection walks only what serving made since (a
    # replica's own info says so: a setting, RAY_SERVE_FREEZE_GC_ON_STARTUP, can turn it off)
    small, larges = router_info(), large_infos()
    ingress = serve.get_deployment_handle("Ingress", "backoff").info.remote().result(timeout_s=30)
    for info in (small, ingress, *larges.values()):
        assert info.gc.frozen > 10_000, info.replica  # torch and Ray alone hold more
        assert len(info.gc.collections) == 3 and all(c >= 0 for c in info.gc.collections)
    assert len({small.pid, ingress.pid, *(i.pid for i in larges.values())}) == 2 + len(larges)


def test_grpc_unary_stream_and_invalid_argument(served):
    with BackoffGrpcClient(served.grpc_target, application="backoff") as client:
        unary = client.complete("w3 w4 w5", max_tokens=10, temperature=0, ignore_eos=True)
        deltas = list(client.stream("w3 w4 w5", max_tokens=10, temperature=0, ignore_eos=True))
        chat = client.chat([{"role": "user", "content": "w3 w4"}], max_tokens=4, temperature=0, ignore_eos=True)
        assert client.models() == ["backoff"] and client.health()
        with pytest.raises(BadRequestError) as bad:
            client.complete("w3", router="nope")
    assert [d.token_id for d in deltas[:-1]] == unary.token_ids and deltas[-1].usage == unary.usage
    assert len(chat.token_ids) == 4 and bad.value.status == "INVALID_ARGUMENT"

    async def run():
        async with AsyncBackoffGrpcClient(served.grpc_target, application="backoff") as client:
            return [d async for d in client.stream("w3 w4 w5", max_tokens=10, temperature=0, ignore_eos=True)]

    assert [d.token_id for d in asyncio.run(run())[:-1]] == unary.token_ids
    with grpc.insecure_channel(served.grpc_target) as channel:  # the raw status code
        stub = pb_grpc.BackoffStub(channel)
        for bad_request in (
            pb.GenerateRequest(prompt="w3", top_p=2.0),
            pb.GenerateRequest(),
            pb.GenerateRequest(prompt_ids=[3] * 600, max_tokens=8),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(bad_request, metadata=APP)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                list(stub.GenerateStream(bad_request, metadata=APP))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "w3", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "w3", "n": 0}, "n"),
        ({"prompt": "w3", "temperature": -1}, "temperature"),
        ({"prompt": "w3", "router": "nope"}, None),
        ({"prompt": [3] * 600, "max_tokens": 8}, None),  # over the context window
        ({"prompt": [3, 4000]}, None),  # token id outside the vocabulary
        ({"prompt": "w3", "backoff_threshold": [2.0, 1.0]}, None),  # not ascending
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_bad_http_input_is_a_400_with_an_openai_error_body(served, body, param):
    for stream in (False, True):
        response = httpx.post(f"{served.url}/v1/completions", json={**body, "stream": stream}, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["message"] and (param is None or error["param"] == param)


def test_wrong_model_and_malformed_json(served):
    r = httpx.post(f"{served.url}/v1/completions", json={"prompt": "w3", "model": "gpt-9"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(
        f"{served.url}/v1/chat/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    with BackoffHTTPClient(served.url, model="gpt-9") as client, pytest.raises(NotFoundError):
        client.complete("w3")


def test_openai_package_works_unchanged(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["backoff"]
    extra = {"ignore_eos": True, "backoff_threshold": THRESHOLD}
    done = client.completions.create(model="backoff", prompt="w3 w4 w5", max_tokens=12, temperature=0, extra_body=extra)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 12
    assert done.usage.model_extra["small_tokens"] + done.usage.model_extra["large_tokens"] == 12
    chunks = list(
        client.completions.create(
            model="backoff", prompt="w3 w4 w5", max_tokens=12, temperature=0, stream=True, extra_body=extra
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    chat = client.chat.completions.create(
        model="backoff", messages=[{"role": "user", "content": "w3 w4"}], max_tokens=6, temperature=0, extra_body=extra
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model="backoff",
        messages=[{"role": "user", "content": "w3 w4"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    parts = list(stream)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content
    assert parts[-1].usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="backoff", prompt="w3", max_tokens=4, extra_body={"router": "nope"})


def test_logprobs_over_the_openai_package_our_clients_and_grpc(served, local):
    """Each token's log-probability under its source model, equal to the in-process engine's,
    in OpenAI's shapes (unary and streamed), with the sources beside them in `backoff`."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    prompt, n = [3, 4, 5, 6], 20
    ref = reference(local, prompt, n, logprobs=3)
    assert set(ref.sources) == {0, 1}  # both models' distributions are reported
    want = [e.chosen.logprob for e in ref.logprobs]
    extra = {"ignore_eos": True, "backoff_threshold": THRESHOLD}
    args = dict(model="backoff", prompt=prompt, max_tokens=n, temperature=0, logprobs=2, extra_body=extra)
    done = client.completions.create(**args)
    lp = done.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert [list(top)[:2] for top in lp.top_logprobs] == [[t.token for t in e.top[:2]] for e in ref.logprobs]
    assert done.choices[0].model_extra["backoff"]["sources"] == list(ref.sources)
    chunks = [
        c.choices[0].logprobs
        for c in client.completions.create(**args, stream=True)
        if c.choices and c.choices[0].logprobs
    ]
    assert [c.token_logprobs[0] for c in chunks] == lp.token_logprobs and [c.tokens[0] for c in chunks] == lp.tokens

    chat_args = dict(
        model="backoff",
        messages=[{"role": "user", "content": "w3 w4"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=extra,
    )
    content = client.chat.completions.create(**chat_args).choices[0].logprobs.content
    assert len(content) == 6 and all(len(e.top_logprobs) == 3 and bytes(e.bytes) == e.token.encode() for e in content)
    assert all(
        [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        and e.logprob <= e.top_logprobs[0].logprob
        for e in content
    )
    streamed = [
        e
        for part in client.chat.completions.create(**chat_args, stream=True)
        if part.choices and part.choices[0].logprobs
        for e in part.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**{**chat_args, "logprobs": False})  # top_logprobs needs logprobs

    fields = dict(max_tokens=n, temperature=0, ignore_eos=True, logprobs=3, backoff_threshold=THRESHOLD)
    with BackoffHTTPClient(served.url) as http, BackoffGrpcClient(served.grpc_target, application="backoff") as rpc:
        for c in (http, rpc):
            unary = c.complete(prompt, **fields)
            assert [e.logprob for e in unary.logprobs] == pytest.approx(want, abs=1e-4)
            assert [[t.token for t in e.top_logprobs] for e in unary.logprobs] == [
                [t.token for t in e.top] for e in ref.logprobs
            ]
            deltas = [d for d in c.stream(prompt, **fields) if d.logprobs is not None]
            assert [d.logprobs.token_id for d in deltas] == list(ref.token_ids)
            assert [d.source for d in deltas] == list(ref.sources)
            assert [
                len(e.top_logprobs)
                for e in c.chat([{"role": "user", "content": "w3"}], max_tokens=4, ignore_eos=True, logprobs=1).logprobs
            ] == [1] * 4
            assert c.complete(prompt, max_tokens=2).logprobs is None
        assert [t.token_id for t in rpc.complete(prompt, **fields).logprobs[0].top_logprobs] == [
            t.token_id for t in ref.logprobs[0].top
        ]

    async def run_async():
        async with (
            AsyncBackoffHTTPClient(served.url) as http,
            AsyncBackoffGrpcClient(served.grpc_target, application="backoff") as rpc,
        ):
            return (
                await http.complete(prompt, **fields),
                [d async for d in http.stream(prompt, **fields)],
                await rpc.complete(prompt, **fields),
                [d async for d in rpc.stream(prompt, **fields)],
            )

    http_unary, http_deltas, rpc_unary, rpc_deltas = asyncio.run(run_async())
    for unary, deltas in ((http_unary, http_deltas), (rpc_unary, rpc_deltas)):
        assert [e.logprob for e in unary.logprobs] == pytest.approx(want, abs=1e-4)
        assert [d.logprobs.logprob for d in deltas if d.logprobs] == pytest.approx(want, abs=1e-4)


def test_disconnect_frees_the_sessions(served):
    with httpx.stream(
        "POST",
        f"{served.url}/v1/completions",
        timeout=60,
        json={
            "prompt": [3, 4, 5],
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
            "router": "always-large",
            "stream": True,
        },
    ) as response:
        lines = response.iter_lines()
        seen = [line for _, line in zip(range(6), (x for x in lines if x.startswith("data:")))]
        assert len(seen) == 6 and any(large_infos()[r].sessions for r in large_infos())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if router_info().live == 0 and not any(i.sessions for i in large_infos().values()):
            break
        time.sleep(0.2)
    else:
        pytest.fail("sessions still held after the client went away")


def test_sessions_go_to_their_replica(served):
    infos = large_infos()
    assert len(infos) == 2  # both replicas serve
    assert sum(i.calls for i in infos.values()) > 0 and all(i.lost == 0 for i in infos.values())
    assert router_info().sessions_lost == 0


def test_prometheus_metrics_are_exported(served):
    wanted = [
        "ray_backoff_tokens_total",
        'source="small"',
        'source="large"',
        "ray_backoff_large_forward_passes_total",
        "ray_backoff_large_sessions",
        "ray_backoff_time_to_first_token_s",
        "ray_backoff_large_forward_batch_size",
        "ray_backoff_catch_up_length",
        "ray_backoff_threshold",
        "ray_backoff_requests",
        "ray_backoff_request_latency_s",
        "ray_backoff_request_backoff_rate",
    ]
    deadline = time.monotonic() + 60  # the metrics agent lags on a loaded machine
    while True:
        text = httpx.get(f"{served.metrics_url}/metrics", timeout=10).text
        missing = [w for w in wanted if w not in text]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, missing


def test_metrics_on_the_http_port_carry_every_replicas_series_by_their_documented_names(served):
    """GET /metrics through Serve: the Ingress's broadcasts reach both SmallModel and LargeModel
    replicas (tests/deployments/serving/test_metrics_http.py checks the counts on the fakes)."""
    body = {"prompt": [3, 4, 5], "max_tokens": 4, "ignore_eos": True, "router": "always-large"}
    assert httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).status_code == 200
    reply = httpx.get(f"{served.url}/metrics", timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    large = {
        line.split('replica="')[1].split('"')[0]
        for line in reply.text.splitlines()
        if line.startswith("backoff_large_sessions{")
    }
    assert large == set(large_infos()), (large, set(large_infos()))  # every LargeModel replica answered
    for wanted in (
        'backoff_tokens_total{deployment="SmallModel",replica=',
        'source="large"',
        "backoff_request_latency_s_bucket{",
    ):
        assert wanted in reply.text, wanted
    assert "ray_backoff" not in reply.text


def test_a_chain_of_three_serves_through_one_more_deployment(served):
    engine = in_process_engine(*(served.model_dirs[name] for name in ("small", "medium", "large")))
    prompt = [6, 5, 4, 3]
    ref = engine.generate(
        GenerationRequest(
            tuple(prompt),
            SamplingParams(max_tokens=24, ignore_eos=True, seed=5, temperature=0),
            RoutingParams(router="random", thresholds=CHAIN_THRESHOLDS),
        )
    )
    assert set(ref.sources) == {0, 1, 2}
    with (
        BackoffHTTPClient(f"{served.url}/chain") as http,
        BackoffGrpcClient(served.grpc_target, application="chain") as rpc,
    ):
        for client in (http, rpc):
            out = client.complete(prompt, max_tokens=24, temperature=0, seed=5, ignore_eos=True)
            assert (out.token_ids, out.sources) == (list(ref.token_ids), list(ref.sources))
            assert out.usage.large_tokens == ref.sources.count(2)
    medium_info = serve.get_deployment_handle("MediumModel1", "chain").info.remote().result(timeout_s=30)
    assert medium_info.name == "medium1" and medium_info.forward_passes > 0


def test_the_playground_of_a_chain_colours_three_sources_under_its_route_prefix(served):
    """/chain/playground reads /chain/v1/routing (three levels, the live random router and its
    two thresholds) and, in headless Chromium, colours small, medium and large tokens."""
    info = httpx.get(f"{served.url}/chain/v1/routing", timeout=30).json()
    assert info["levels"] == ["small", "medium1", "large"] and info["router"] == "random"
    assert info["thresholds"] == list(CHAIN_THRESHOLDS)
    missing = browser_missing()
    if missing:
        pytest.skip(missing)
    prompt, fields = "w6 w5 w4 w3", dict(max_tokens=24, temperature=0, seed=5, ignore_eos=True)
    with BackoffHTTPClient(f"{served.url}/chain") as http:
        reference = http.complete(prompt, **fields)
    assert set(reference.sources) == {0, 1, 2}
    with PlaygroundPage(f"{served.url}/chain") as page:
        page.ready()
        legend = page.js(
            "return [...document.querySelectorAll('#legend .swatch')].map(s => s.className + ' ' + s.textContent)"
        )
        assert legend == ["swatch s-small small", "swatch s-medium medium1", "swatch s-large large"]
        assert page.js("return [...document.querySelectorAll('#panel-a input.threshold')].map(i => +i.value)") == list(
            CHAIN_THRESHOLDS
        )  # panel a starts from the live config
        page.set(mode="plain", prompt=prompt, **fields)
        page.run()
        a = page.panel("a")
        medium_spans = page.js("return document.querySelectorAll('#panel-a .tok.s-medium').length")
    assert a.status == "done (length)" and (a.text, a.sources) == (reference.text, reference.sources), a
    assert medium_spans == reference.sources.count(1) and a.counters["tokens"] == (
        f"24 ({reference.sources.count(0)} small / {reference.sources.count(1)} medium / "
        f"{reference.sources.count(2)} large)"
    )


@pytest.mark.parametrize("target, max_tokens", [(0.0, 8), (1.0, 8), (0.01, 2), (0.99, 2)])
def test_target_backoff_at_the_extremes_answers_finite_json(served, target, max_tokens):
    """The rate controller's "every step large / small" threshold was ±inf: a plain-text 500
    after the whole generation. Now a finite threshold, in JSON and in protobuf."""
    body = {
        "prompt": [3, 4, 5],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "target_backoff": target,
    }
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    thresholds = json.loads(response.text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))["choices"][0][
        "backoff"
    ]["thresholds"]
    assert len(thresholds) == 1 and math.isfinite(thresholds[0])
    if target in (0.0, 1.0):
        assert response.json()["usage"]["small_tokens"] == (max_tokens if target else 0)
    with grpc.insecure_channel(served.grpc_target) as channel:
        fields = {k: v for k, v in body.items() if k != "prompt"}
        reply = pb_grpc.BackoffStub(channel).Generate(
            pb.GenerateRequest(prompt_ids=body["prompt"], **fields), metadata=APP, timeout=60
        )
    assert len(reply.thresholds) == 1 and math.isfinite(reply.thresholds[0])
