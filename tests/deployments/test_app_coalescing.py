"""Coalesced token messages over a real (local, CPU) Ray Serve app and the real clients.

Two applications with a tiny message budget (StreamConfig: 20 messages a second, so a
stream's tokens ride together, up to 40 ms of them): `standin` runs the SmallModel over the
benchmark's stand-in engine (benchmarks/standin.py, 2 ms a step, tokens scripted by seed),
`real` over the tiny models. A client must see every token once, in order, with its source,
the first token alone in the first message, and the same tokens, text, logprobs, stop and
usage as the unary answer; a cancelled stream must leave the step loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time

import grpc
import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from benchmarks.standin import expected_stream  # noqa: E402
from clients.grpc_client import AsyncBackoffGrpcClient  # noqa: E402
from clients.http_client import AsyncBackoffHTTPClient  # noqa: E402
from clients.wire import backoff_pb2 as pb  # noqa: E402
from clients.wire import backoff_pb2_grpc as pb_grpc  # noqa: E402
from clients.wire.proto import deltas_from_pb  # noqa: E402
from tests.support.served_app import TINY_PAIR, ServedApp, sse_then_disconnect  # noqa: E402
from tests.support.tiny import tiny_model  # noqa: E402

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)
BUDGET = {"max_messages_per_s": 20.0, "max_delay_ms": 40.0}
PROMPT = [3, 7, 11]
MODELS = {**TINY_PAIR, "large": functools.partial(tiny_model, 2, hidden=64, layers=4)}  # a flat M_L


def _edit(config: dict, dirs) -> None:
    real = config["applications"][0]
    real.update(name="real", route_prefix="/real")
    real["args"]["stream"] = BUDGET
    standin = json.loads(json.dumps(real))
    standin.update(name="standin", route_prefix="/standin")
    standin["args"]["engine_factory"] = "benchmarks.standin:engine_2ms"
    config["applications"].append(standin)


@pytest.fixture(scope="module")
def served(serve_app) -> ServedApp:
    return serve_app("coalescing", MODELS, edit=_edit)  # the replicas import benchmarks.standin: LOCAL_ENV


def _router(app: str):
    return serve.get_deployment_handle("SmallModel", app).info.remote().result(timeout_s=30)


async def _raw_grpc(target: str, app: str, request: pb.GenerateRequest) -> list[pb.GenerateChunk]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.BackoffStub(channel)
        return [m async for m in stub.GenerateStream(request, metadata=(("application", app),), timeout=120)]


def test_grpc_batches_carry_every_token_once_in_order_and_the_first_alone(served):
    target = served.grpc_target
    n = 120

    async def main():
        requests = [pb.GenerateRequest(prompt_ids=PROMPT, max_tokens=n, seed=s, ignore_eos=True) for s in (1, 2, 3)]
        return await asyncio.gather(*[_raw_grpc(target, "standin", r) for r in requests])

    for seed, messages in zip((1, 2, 3), asyncio.run(main())):
        first, last = messages[0], messages[-1]
        assert not first.tokens and first.index == 0 and first.token_id == expected_stream(seed, 1)[0][0]
        assert max(len(m.tokens) for m in messages) >= 2, "no message carried several tokens"
        assert len(messages) < n  # fewer messages than tokens
        deltas = [d for m in messages[:-1] for d in deltas_from_pb(m)]
        assert [(d.token_id, d.source, d.text) for d in deltas] == expected_stream(seed, n)
        assert [d.index for d in deltas] == list(range(n)) and {d.id for d in deltas} == {first.id}
        sources = [s for _, s, _ in expected_stream(seed, n)]
        assert last.finish_reason == "length" and last.usage.completion_tokens == n
        assert (last.usage.small_tokens, last.usage.large_tokens) == (sources.count(0), sources.count(1))


def test_sse_batches_are_one_event_per_token_for_every_client(served):
    url, target = served.url, served.grpc_target
    n = 100

    async def client_stream(make):
        async with make() as client:
            return [d async for d in client.stream(PROMPT, max_tokens=n, seed=5, ignore_eos=True)]

    async def raw_events() -> list[dict]:
        body = {"prompt": PROMPT, "max_tokens": n, "seed": 5, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=f"{url}/standin", timeout=120) as http:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                return [
                    json.loads(line[5:])
                    async for line in response.aiter_lines()
                    if line.startswith("data:") and not line.endswith("[DONE]")
                ]

    expected = expected_stream(5, n)
    for make in (
        lambda: AsyncBackoffHTTPClient(f"{url}/standin"),
        lambda: AsyncBackoffGrpcClient(target, application="standin"),
    ):
        deltas = asyncio.run(client_stream(make))
        assert [(d.token_id, d.source, d.text) for d in deltas if d.token_id is not None] == expected
        assert deltas[-1].usage.completion_tokens == n
    events = asyncio.run(raw_events())
    assert len(events) == n + 1  # an OpenAI client counts one chunk per token, then the usage chunk
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "".join(t for _, _, t in expected)


def test_a_cancelled_stream_leaves_the_step_loop_while_another_finishes(served):
    url, target = served.url, served.grpc_target
    before = _router("standin").cancelled

    async def disconnected() -> int:
        """An SSE client that goes away after the first token and one batch (4000 tokens: 8 s)."""
        body = {"prompt": PROMPT, "max_tokens": 4000, "seed": 7, "ignore_eos": True, "stream": True}
        return await sse_then_disconnect(f"{url}/standin", body)

    async def main():
        whole = _raw_grpc(
            target, "standin", pb.GenerateRequest(prompt_ids=PROMPT, max_tokens=80, seed=8, ignore_eos=True)
        )
        return await asyncio.gather(disconnected(), whole)

    reads, messages = asyncio.run(main())
    assert reads == 2
    deltas = [d for m in messages[:-1] for d in deltas_from_pb(m)]
    assert [(d.token_id, d.source, d.text) for d in deltas] == expected_stream(8, 80)
    deadline = time.monotonic() + 6  # well before the 8 s the stream would take to finish
    while (info := _router("standin")).live or info.admitted:
        assert time.monotonic() < deadline, f"the cancelled stream is still in the step loop: {info}"
        time.sleep(0.2)
    assert info.cancelled == before + 1


def _logprobs(entry) -> tuple:
    return entry.token, entry.logprob, tuple((t.token, t.logprob) for t in entry.top_logprobs)


def test_real_engine_batches_equal_the_unary_answer_with_stop_and_logprobs(served):
    url, target = served.url, served.grpc_target
    params = dict(
        max_tokens=40, temperature=0.0, seed=3, ignore_eos=True, router="random", backoff_threshold=[0.5], logprobs=2
    )

    async def run(stop):
        extra = {"stop": [stop]} if stop else {}
        async with (
            AsyncBackoffHTTPClient(f"{url}/real") as http,
            AsyncBackoffGrpcClient(target, application="real") as rpc,
        ):
            unary = await rpc.complete(PROMPT, **params, **extra)
            streams = [[d async for d in c.stream(PROMPT, **params, **extra)] for c in (http, rpc)]
        return unary, streams

    unary, _ = asyncio.run(run(None))
    stop = unary.text[len(unary.text) // 2 :][:3]  # cuts the text half way
    unary, streams = asyncio.run(run(stop))
    assert unary.finish_reason == "stop" and len(unary.token_ids) < 40
    for deltas in streams:
        tokens = [d for d in deltas if d.token_id is not None]
        assert [d.token_id for d in tokens] == unary.token_ids and [d.source for d in tokens] == unary.sources
        assert "".join(d.text for d in tokens) == unary.text
        # (the OpenAI completions shape carries no bytes: compare what every transport has)
        assert [_logprobs(d.logprobs) for d in tokens] == [_logprobs(e) for e in unary.logprobs]
        assert deltas[-1].finish_reason == "stop" and deltas[-1].usage == unary.usage
    request = pb.GenerateRequest(
        prompt_ids=PROMPT,
        max_tokens=40,
        temperature=0.0,
        seed=3,
        ignore_eos=True,
        router="random",
        backoff_threshold=[0.5],
    )
    messages = asyncio.run(_raw_grpc(target, "real", request))
    assert max(len(m.tokens) for m in messages) >= 2, "the real engine's stream was not coalesced"
