"""Access control and operations against the real Serve application on loopback (tiny models;
the app and its calls: tests/support/input_app.py): API keys over HTTP, gRPC, our clients and
the openai package; concurrent requests per client capped; Ray's own `serve status` and
`serve deploy` changing the live threshold, with its gauge; the playground page in a real
browser.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

pytest.importorskip("ray")
from ray import serve  # noqa: E402

from clients import AuthenticationError, BadRequestError, RateLimitError, cli  # noqa: E402
from clients.grpc_client import BackoffGrpcClient  # noqa: E402
from clients.http_client import BackoffHTTPClient  # noqa: E402
from clients.wire import backoff_pb2 as pb  # noqa: E402
from clients.wire import backoff_pb2_grpc as pb_grpc  # noqa: E402
from clients.wire.types import Usage  # noqa: E402
from deployments import serve_cli  # noqa: E402
from tests.support import input_app  # noqa: E402
from tests.support.input_app import (  # noqa: E402
    ENV_KEY,
    KEY,
    LIMITS,
    W,
    auth,
    grpc_meta,
    openai_error,
    post,
    wait_idle,
)
from tests.support.playground_page import PlaygroundPage, browser_missing  # noqa: E402
from tests.support.served_app import ServedApp, deployment_config, wait_until  # noqa: E402

pytestmark = pytest.mark.ray  # starts a local Ray and the Serve app (slow, one at a time)
SHARED_APP = input_app.SHARED_KEY  # the app of test_app_input*.py, deployed once for the three
PLAYGROUND_ROUTER = ("random", 0.5)  # the playground test's: half the tokens small, drawn from the seed


@pytest.fixture(scope="module")
def served(shared_app) -> ServedApp:
    return shared_app(SHARED_APP, input_app.start)


# -- access: API keys ---------------------------------------------------------------------------


def test_http_needs_an_api_key_except_for_health(served):
    body = {"prompt": W, "max_tokens": 2}
    for headers in ({}, auth("wrong"), {"Authorization": KEY}, {"Authorization": "Basic abc"}):
        r = post(served, body, headers=headers)
        assert r.status_code == 401 and openai_error(r)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer" and "wrong" not in r.text
    r = post(served, b"{not json", headers={})  # the key is checked before the body is read
    assert r.status_code == 401
    assert httpx.get(f"{served.url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{served.url}/health", timeout=30).status_code == 200  # open: load balancers probe it
    for key in (KEY, ENV_KEY):  # from the config's args and from the environment variable
        assert post(served, body, headers=auth(key)).status_code == 200


def test_openai_package_gets_authentication_error_and_works_with_the_key(served):
    openai = pytest.importorskip("openai")
    wrong = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="backoff", prompt=W, max_tokens=2)
    right = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0)
    done = right.completions.create(model="backoff", prompt=W, max_tokens=2, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError):
        right.completions.create(model="backoff", prompt=W, max_tokens=10**6)


def test_grpc_needs_an_api_key_except_for_health(served):
    request = pb.GenerateRequest(prompt=W, max_tokens=2, ignore_eos=True)
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.BackoffStub(channel)
        for meta in ((), grpc_meta("wrong"), (("authorization", KEY),)):
            for call in (
                lambda meta=meta: stub.Generate(request, metadata=meta, timeout=60),
                lambda meta=meta: list(stub.GenerateStream(request, metadata=meta, timeout=60)),
                lambda meta=meta: stub.Models(pb.ModelsRequest(), metadata=meta, timeout=60),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Health(pb.HealthRequest(), timeout=60).ok
        assert stub.Generate(request, metadata=grpc_meta(ENV_KEY), timeout=60).usage.completion_tokens == 2


def test_clients_send_the_key_from_the_argument_or_the_environment(served, monkeypatch, capsys):
    monkeypatch.delenv("BACKOFF_API_KEY", raising=False)
    with BackoffHTTPClient(served.url) as http, BackoffGrpcClient(served.grpc_target) as rpc:
        for client in (http, rpc):
            with pytest.raises(AuthenticationError):
                client.complete(W, max_tokens=2, ignore_eos=True)
    with BackoffHTTPClient(served.url, api_key=KEY) as http, BackoffGrpcClient(served.grpc_target, api_key=KEY) as rpc:
        assert http.complete(W, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        assert rpc.complete(W, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        assert http.models() == rpc.models() == ["backoff"]
        for client in (http, rpc):  # a refused request is the same exception on both transports
            with pytest.raises(BadRequestError):
                client.complete(W, max_tokens=10**6)
    monkeypatch.setenv("BACKOFF_API_KEY", ENV_KEY)
    with BackoffHTTPClient(served.url) as http, BackoffGrpcClient(served.grpc_target) as rpc:
        assert http.complete(W, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        assert rpc.complete(W, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    assert cli.main(["--url", served.url, "generate", W, "--max-tokens", "2", "--ignore-eos", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["usage"]["completion_tokens"] == 2
    monkeypatch.delenv("BACKOFF_API_KEY")
    assert cli.main(["--grpc", served.grpc_target, "--api-key", KEY, "models"]) == 0
    assert cli.main(["--grpc", served.grpc_target, "models"]) == 2  # refused: a client error
    assert "AuthenticationError" in capsys.readouterr().err


# -- access: concurrent requests per client -------------------------------------------------------


def test_concurrent_requests_per_client_are_capped(served):
    long = {
        "prompt": [3, 4, 5],
        "max_tokens": 470,
        "ignore_eos": True,
        "router": "always-large",
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(base_url=served.url, timeout=60, headers=auth()) as http, ExitStack() as open_streams:
        responses = [open_streams.enter_context(http.stream("POST", "/v1/completions", json=long)) for _ in range(2)]
        readers = [r.iter_lines() for r in responses]  # kept: dropping one would close its connection
        for response, reader in zip(responses, readers):  # both admitted and generating
            assert response.status_code == 200
            assert next(line for line in reader if line.startswith("data:")).startswith('data: {"id"')
        slots = serve.get_deployment_handle("Ingress", "backoff").info.remote().result(timeout_s=30)
        assert list(slots.open_by_client.values()) == [2]  # one client (by key digest), two requests
        third = http.post("/v1/completions", json={"prompt": W, "max_tokens": 2})
        assert third.status_code == 429 and third.headers["retry-after"] == str(LIMITS["retry_after_s"])
        error = openai_error(third)
        assert error["type"] == "rate_limit_error" and "per ingress replica" in error["message"]
        with BackoffHTTPClient(served.url, api_key=KEY) as client, pytest.raises(RateLimitError) as limited:
            client.complete(W, max_tokens=2, ignore_eos=True)
        assert limited.value.retry_after_s == LIMITS["retry_after_s"]
        with grpc.insecure_channel(served.grpc_target) as channel:  # the same client over gRPC
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.BackoffStub(channel).Generate(
                    pb.GenerateRequest(prompt=W, max_tokens=2), metadata=grpc_meta(), timeout=60
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(err.value.trailing_metadata())["retry-after"] == str(LIMITS["retry_after_s"])
        other = post(served, {"prompt": W, "max_tokens": 2}, headers=auth(ENV_KEY))  # another client
        assert other.status_code == 200
    wait_idle()  # disconnects free the slots
    assert post(served, {"prompt": W, "max_tokens": 2}).status_code == 200


# -- Ray's own CLI: `serve status` and `serve deploy` (a live threshold change), the threshold gauge -----


def _gauge(metrics_url: str) -> dict[str, float]:
    """ray_backoff_threshold of the `backoff` app: boundary -> value."""
    found = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("ray_backoff_threshold{") and 'application="backoff"' in line:
            labels, value = line.rsplit(" ", 1)
            found[re.search(r'boundary="(\d+)"', labels).group(1)] = float(value)
    return found


def _eventually(predicate, what: str) -> None:
    wait_until(predicate, what, 60.0, every_s=0.5)


def test_serve_cli_status_and_deploy_change_the_live_threshold(served, tmp_path):
    hints = serve_cli.local_ray_hints()  # what `backoff serve` prints about this Ray (metrics URL, auth for Ray's CLI)
    metrics_url = re.search(r"http://\S+/metrics", hints).group(0)
    # published from the start: the config names no threshold, so the entropy router's default
    _eventually(lambda: _gauge(metrics_url) == {"0": 2.0}, f"no threshold gauge at start: {_gauge(metrics_url)}")
    # Ray's CLI in a fresh shell, given exactly what `backoff serve` says to export
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env.update(re.findall(r"export (\w+)=(\S+)", hints))
    cli_ = str(Path(sys.executable).with_name("serve"))
    edited = yaml.safe_load(served.config_path.read_text())
    deployment_config(edited, "SmallModel")["user_config"]["thresholds"] = [0.25]
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(edited))
    deploy = subprocess.run(
        [cli_, "deploy", str(path), "--address", served.dashboard], env=env, capture_output=True, text=True, timeout=120
    )
    assert deploy.returncode == 0, deploy.stderr[-2000:]
    status = subprocess.run(
        [cli_, "status", "--address", served.dashboard], env=env, capture_output=True, text=True, timeout=120
    )
    assert status.returncode == 0 and "backoff" in status.stdout, status.stderr[-2000:]
    _eventually(
        lambda: (
            serve.get_deployment_handle("SmallModel", "backoff").info.remote().result(timeout_s=30).policy.thresholds
            == [0.25]
        ),
        "the deploy did not reach the SmallModel",
    )
    reply = post(served, {"prompt": W, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["choices"][0]["backoff"]["thresholds"] == [0.25], reply.text
    _eventually(lambda: _gauge(metrics_url) == {"0": 0.25}, f"the gauge did not follow: {_gauge(metrics_url)}")


# -- the playground page in a real browser (it sets its router and threshold: the live change above is no matter)


def test_playground_asks_for_the_key_and_colours_each_token_by_its_source(served, tmp_path):
    """Headless Chromium on /playground: the page loads without a key, shows the server's 401
    message, takes the key; a prompt at a threshold that mixes sources streams into
    spans of both sources, equal to the same request made by our client, and the counters
    show the final chunk's usage; compare mode runs always-large beside it; a refused
    request shows the server's message."""
    missing = browser_missing()
    if missing:
        pytest.skip(missing)
    page_html = httpx.get(f"{served.url}/playground", timeout=30)  # no key: the page itself is open
    assert page_html.status_code == 200 and "playground/playground.js" in page_html.text
    assert httpx.get(f"{served.url}/playground/playground.js", timeout=30).status_code == 200
    assert httpx.get(f"{served.url}/v1/routing", timeout=30).status_code == 401  # the data is not
    prompt, fields = "w3 w5 w7 w11", dict(max_tokens=24, temperature=0, seed=5, ignore_eos=True)
    router, threshold = PLAYGROUND_ROUTER
    with BackoffHTTPClient(served.url, api_key=KEY) as client:
        reference = client.chat(
            [{"role": "user", "content": prompt}], router=router, backoff_threshold=threshold, **fields
        )
    assert {0, 1} <= set(reference.sources)  # the threshold mixes sources
    with PlaygroundPage(served.url) as page:
        _playground_takes_the_key(page)
        page.set(prompt=prompt, mode="chat", temperature=0, max_tokens=24, seed=5, ignore_eos=True)
        page.set_panel("a", router, [threshold])
        a = _playground_run_equals(page, reference)
        _playground_compares_with_always_large(page, a, Path(os.environ.get("BACKOFF_RESULTS", tmp_path)))
        _playground_shows_a_refusal(page)
        _playground_drops_retracted_spans(page)


def _playground_takes_the_key(page: PlaygroundPage) -> None:
    """No key: the server's message; a wrong key: refused; the right one: the page is ready."""
    page.wait("return !document.getElementById('key-dialog').hidden")
    assert "no API key" in page.key_dialog()[1]
    page.enter_key("wrong")
    page.wait("return document.getElementById('key-error').textContent.includes('not valid')")
    page.enter_key(KEY)
    page.ready()
    assert page.key_dialog()[0] is False


def _playground_run_equals(page: PlaygroundPage, reference):
    """Panel a's run: the client's text and sources, the final chunk's usage in its counters."""
    page.run()
    a = page.panel("a")
    assert a.status == "done (length)" and not a.error, a
    assert a.text == reference.text and a.sources == reference.sources, (a, reference)
    usage = Usage(**a.usage)
    assert usage == reference.usage and len(a.sources) == usage.completion_tokens
    assert (a.sources.count(0), a.sources.count(1)) == (usage.small_tokens, usage.large_tokens)
    assert a.counters["rate"] == f"{100 * usage.backoff_rate:.1f} %"
    assert a.counters["large-calls"] == str(usage.large_calls) and usage.large_calls > 0
    assert a.counters["tokens"].startswith(f"{usage.completion_tokens} (")
    assert a.counters["ttft"].endswith(" ms") and float(a.counters["tps"]) > 0
    return a


def _playground_compares_with_always_large(page: PlaygroundPage, a, results: Path) -> None:
    page.set(compare=True)  # panel b: always-large beside panel a's threshold
    page.run()
    a2, b = page.panel("a"), page.panel("b")
    assert a2.sources == a.sources and a2.text == a.text
    assert b.status == "done (length)" and set(b.sources) == {1} and len(b.sources) == 24, b
    assert b.counters["rate"] == "0.0 %" and b.counters["large-calls"] == str(b.usage["large_calls"])
    page.screenshot(results / "playground.png")


def _playground_shows_a_refusal(page: PlaygroundPage) -> None:
    page.set(compare=False, max_tokens=LIMITS["max_tokens"] + 1)  # over limits.max_tokens: a 400
    page.run()
    refused = page.panel("a")
    assert refused.status == "error" and "limits.max_tokens" in refused.error, refused


def _playground_drops_retracted_spans(page: PlaygroundPage) -> None:
    """A verification rollback (not reachable from a request's fields): the page's own fetch
    answers with chunks in the server's shape; `retracted` drops the last spans."""
    page.js(
        """const chunks = arguments[0].map(c => 'data: ' + JSON.stringify(c) + '\\n\\n').join('')
                   + 'data: [DONE]\\n\\n';
               window.fetch = async () => new Response(chunks, {status: 200,
                                                                headers: {'content-type': 'text/event-stream'}});""",
        _rollback_chunks(),
    )
    page.set(max_tokens=3)
    page.run()
    rolled = page.panel("a")
    assert (rolled.text, rolled.sources, rolled.status) == ("aBd", [0, 1, 0], "done (length)"), rolled
    assert rolled.counters["rate"] == "66.7 %" and rolled.counters["large-calls"] == "1"


def _rollback_chunks() -> list[dict]:
    """a b c from small; the large model's B retracts b and c; d from small."""

    def token(index, source, text, retracted=0):
        return {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "backoff",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": text},
                    "finish_reason": None,
                    "backoff": {
                        "token_id": index,
                        "source": source,
                        "index": index,
                        "retracted": retracted,
                        "retracted_text": "",
                    },
                }
            ],
        }

    usage = Usage(prompt_tokens=1, completion_tokens=3, total_tokens=4, small_tokens=2, large_tokens=1, large_calls=1)
    final = {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "backoff",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
        "usage": usage.model_dump(),
    }
    return [
        token(0, 0, "a"),
        token(1, 0, "b"),
        token(2, 0, "c"),
        token(1, 1, "B", retracted=2),
        token(2, 0, "d"),
        final,
    ]
