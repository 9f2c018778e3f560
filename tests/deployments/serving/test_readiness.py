"""The ready signal (issue 57, item 7) without Ray: Serve's statuses are stand-ins
(tests/support/serve_fakes.serve_status). The Ingress over fakes answers 503 + Retry-After
(`not_ready`) while a deployment of its app has no running replica, then serves, and asks
the controller no more; `backoff serve` prints one ready line with the addresses once every
application runs, `--wait-ready` exits 0 there or 1 with one line, and refuses a local Ray
that would stop with it."""

from __future__ import annotations

import types

import httpx
import pytest
from ray import serve

from deployments import ingress, serve_cli
from deployments.serving.readiness import missing, not_running, ready_line, wait_ready
from tests.support.remote_fakes import LoopThread
from tests.support.serve_fakes import FakeHandle, ingress_replica, large_replica, serve_status, serving, small_replica

BODY = {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_the_ingress_answers_503_not_ready_until_every_deployment_runs_then_serves(monkeypatch, pair, tokenizer):
    lt = LoopThread()
    large = large_replica(monkeypatch, pair[1])
    small = small_replica(monkeypatch, pair[0], tokenizer, [FakeHandle([large], lt)], {})
    replica = ingress_replica(monkeypatch, small, {"admission": {"retry_after_s": 4}})
    asked: list[str] = []
    now = {"starting": ("SmallModel", "LargeModel")}

    def status():
        asked.append("status")
        return serve_status(starting=now["starting"])

    monkeypatch.setattr(serve, "status", status)
    replica.readiness.every_s = 0.0  # ask on every request while not ready
    try:
        with serving(ingress.app) as base, httpx.Client(base_url=base, timeout=30) as http:
            for path, method in (("/v1/completions", "POST"), ("/v1/models", "GET"), ("/v1/routing", "GET")):
                r = http.request(method, path, json=BODY if method == "POST" else None)
                assert r.status_code == 503 and r.headers["Retry-After"] == "4", (path, r.text)
                error = r.json()["error"]
                assert (
                    error["code"] == "not_ready"
                    and "SmallModel, LargeModel have no running replica" in error["message"]
                )
            health = http.get("/health")
            assert health.status_code == 503 and "no running replica" in health.json()["error"]["message"]
            now["starting"] = ("LargeModel",)
            assert (
                "LargeModel has no running replica"
                in http.post("/v1/completions", json=BODY).json()["error"]["message"]
            )
            now["starting"] = ()
            served = http.post("/v1/completions", json=BODY)
            assert served.status_code == 200 and len(served.json()["choices"][0]["backoff"]["token_ids"]) == 4
            assert http.get("/health").json() == {"status": "ok"}
            calls = len(asked)
            now["starting"] = ("SmallModel",)  # ready latches: the controller is not asked again
            assert http.post("/v1/completions", json=BODY).status_code == 200 and len(asked) == calls
    finally:
        small.loop.stop()
        large.batcher.shutdown()
        lt.stop()


def test_a_status_that_cannot_be_read_serves_rather_than_refuses():
    import asyncio

    from deployments.serving.readiness import Readiness

    async def failing() -> str:
        raise ConnectionError("controller")

    readiness = Readiness(failing)
    assert asyncio.run(readiness.problem()) == "" and readiness.ready


def test_a_caller_waits_at_most_wait_s_for_a_slow_controller():
    import asyncio

    from deployments.serving.readiness import Readiness

    async def main() -> tuple[str, str]:
        answer = asyncio.Event()

        async def slow() -> str:
            await answer.wait()
            return ""

        readiness = Readiness(slow, wait_s=0.05)
        first = await readiness.problem()  # not answered within 50 ms: starting, not a hang
        answer.set()
        await asyncio.sleep(0.01)
        return first, await readiness.problem()

    first, then = asyncio.run(main())
    assert first == "Serve's controller has not said yet" and then == ""


def _status(app_state: str = "RUNNING", starting=(), proxies=("HEALTHY",), message: str = ""):
    status = serve_status("backoff", starting)
    status.applications["backoff"].status = app_state
    status.applications["backoff"].message = message
    status.proxies = {f"node-{i}": p for i, p in enumerate(proxies)}
    return status


def test_ready_means_every_application_running_and_the_proxies_healthy():
    assert missing(None) == "the application is not deployed yet"
    assert not_running(_status(), ["backoff"]) == ""
    deploying = not_running(_status("DEPLOYING", ("SmallModel",)), ["backoff"])
    assert deploying == "application 'backoff' is DEPLOYING (SmallModel has no running replica yet)"
    assert not_running(_status(), ["backoff", "tight"]) == "application 'tight' is not deployed yet"
    assert not_running(_status(proxies=("HEALTHY", "STARTING")), ["backoff"]) == "Serve's proxies are starting"
    with pytest.raises(RuntimeError, match="'backoff' failed to deploy: ImportError"):
        not_running(_status("DEPLOY_FAILED", message="ImportError"), ["backoff"])


def test_wait_ready_polls_until_running_and_times_out_naming_what_is_not_up():
    answers = iter([_status("DEPLOYING", ("LargeModel",))] * 3 + [_status()])
    lines: list[str] = []
    assert wait_ready(lambda: next(answers), ["backoff"], 10, lines.append, every_s=0.0, progress_every_s=0.0) >= 0
    assert len(lines) == 3 and "LargeModel has no running replica" in lines[0]
    with pytest.raises(TimeoutError, match=r"not ready after 0.05 s: .*LargeModel"):
        wait_ready(lambda: _status("DEPLOYING", ("LargeModel",)), ["backoff"], 0.05, every_s=0.01)


def test_the_ready_line_names_the_http_and_grpc_addresses_and_the_routes():
    config = {
        "http_options": {"host": "0.0.0.0", "port": 8100},
        "grpc_options": {"port": 9100, "grpc_servicer_functions": ["x"]},
        "applications": [{"name": "backoff", "route_prefix": "/"}, {"name": "tight", "route_prefix": "/tight"}],
    }
    line = ready_line(config, 23.94)
    assert line == (
        "backoff serve: ready after 23.9 s: HTTP http://0.0.0.0:8100 (OpenAI API under /v1), gRPC 0.0.0.0:9100; "
        "backoff at /, tight at /tight"
    )
    assert "gRPC" not in ready_line({"applications": [{"name": "a"}]}, 1.0)


@pytest.fixture
def cli(monkeypatch):
    """serve_cli.main with Ray stood in for: what was submitted, whether it then served on."""
    done = types.SimpleNamespace(submitted=[], served=0, statuses=iter(()))
    monkeypatch.setattr(serve_cli, "start_ray", lambda *args: None)
    monkeypatch.setattr(serve_cli, "run_config", lambda config, blocking: done.submitted.append(blocking))
    monkeypatch.setattr(serve_cli, "serve_until_interrupted", lambda: setattr(done, "served", done.served + 1))
    monkeypatch.setattr(serve, "status", lambda: next(done.statuses))
    monkeypatch.setattr("deployments.serving.readiness.time.sleep", lambda s: None)
    return done


def test_backoff_serve_prints_one_ready_line_then_serves_on(cli, capsys):
    cli.statuses = iter([_status("DEPLOYING", ("SmallModel",)), _status()])
    assert serve_cli.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("backoff serve: ready after ") and "http://127.0.0.1:8000" in out[0]
    assert "gRPC 127.0.0.1:9000; backoff at /" in out[0]
    assert cli.submitted == [False] and cli.served == 1  # submitted, then this process keeps it up


def test_wait_ready_exits_0_once_ready_or_1_with_one_line(cli, capsys):
    cli.statuses = iter([_status("DEPLOYING", ("LargeModel",)), _status()])
    assert serve_cli.main(["--address", "auto", "--wait-ready", "30"]) == 0
    assert capsys.readouterr().out.startswith("backoff serve: ready after ") and cli.served == 0
    cli.statuses = iter(lambda: _status("DEPLOYING", ("LargeModel",)), None)
    assert serve_cli.main(["--address", "auto", "--wait-ready", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "backoff serve: not ready after 0 s: application 'backoff' is DEPLOYING (LargeModel has no "
        "running replica yet); `serve status` has the detail"
    ]
    cli.statuses = iter([_status("DEPLOY_FAILED", message="ImportError: no module x")])
    assert serve_cli.main(["--address", "auto", "--wait-ready"]) == 1
    assert "failed to deploy: ImportError: no module x" in capsys.readouterr().err


def test_wait_ready_needs_a_ray_that_outlives_the_command_and_non_blocking_does_not_wait(cli, capsys, monkeypatch):
    monkeypatch.setattr(serve_cli, "ray_is_running", lambda: False)
    assert serve_cli.main(["--wait-ready", "30"]) == 2
    err = capsys.readouterr().err
    assert "--address auto" in err and len(err.strip().splitlines()) == 1 and cli.submitted == []
    assert serve_cli.main(["--non-blocking"]) == 0  # no status asked: `statuses` is empty
    assert cli.submitted == [False] and capsys.readouterr().out == ""
