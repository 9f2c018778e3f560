"""What the end-to-end modules share (tests/deployments/test_app_e2e.py, test_app_load.py,
then test_app_e2e_live.py, on the same deployed app, SHARED_KEY): the application (entropy
at THRESHOLD, two LargeModel replicas), beside a chain of three whose limits are tiny (the
load module's full app); the in-process reference, and the replicas' info.

Ray is imported lazily, as in served_app.py: collecting the modules must not need it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

from backoff_core.engine.engine import BackoffEngine
from backoff_core.types import GenerationRequest, GenerationResult, RoutingParams, SamplingParams
from deployments import harness, serve_cli
from tests.support.served_app import TINY_PAIR, ServedApp, deployment_config, in_process_engine
from tests.support.tiny import tiny_model

THRESHOLD = 0.4  # entropy threshold of the deployed config: both sources occur
CHAIN_THRESHOLDS = (0.4, 0.7)  # the chain's random router over three levels: ~40 / 30 / 30 %
MODELS = {**TINY_PAIR, "medium": functools.partial(tiny_model, 3, hidden=48, layers=3, sharpness=30)}
SHARED_KEY = "e2e"  # the modules' SHARED_APP (tests/deployments/conftest.py's `shared_app`)
CHAIN_RETRY_AFTER_S = 2.0  # `chain`'s Retry-After (its tiny limits: edit_with_chain)


def edit_entropy(config: dict, dirs) -> None:
    """The SmallModel's router: entropy at THRESHOLD."""
    deployment_config(config, "SmallModel")["user_config"] = {"router": "entropy", "threshold": [THRESHOLD]}


def edit_with_chain(config: dict, dirs) -> None:
    """edit_entropy, and beside it a chain of three: one more LargeModel-like deployment
    (MediumModel1), by config only, as the application `chain` under /chain, one replica of
    each model. Its limits are tiny, for test_app_load.py's backpressure cases (the
    end-to-end tests send it one request at a time): 2 live + 1 waiting requests per
    SmallModel replica, 4 ongoing and 2 queued in Serve."""
    edit_entropy(config, dirs)
    chain = json.loads(json.dumps(config["applications"][0]))
    chain.update(name="chain", route_prefix="/chain")
    chain["args"]["models"]["medium"] = [dirs["medium"]]
    chain["args"]["large"]["num_replicas"] = 1
    chain["args"]["small"].update(max_ongoing_requests=4, max_queued_requests=2)
    chain["args"]["admission"] = {
        "max_live_requests": 2,
        "max_waiting_requests": 1,
        "retry_after_s": CHAIN_RETRY_AFTER_S,
    }
    config["applications"].append(chain)
    deployment_config(config, "SmallModel", app=1)["user_config"] = {
        "router": "random",
        "threshold": list(CHAIN_THRESHOLDS),
    }


def start_with_chain(serve_app: Callable[..., ServedApp]) -> ServedApp:
    """The end-to-end modules' app: `backoff` (start's) and the chain of three."""
    return start(serve_app, "serve-e2e", MODELS, edit=edit_with_chain)


def start(serve_app: Callable[..., ServedApp], name: str, models: dict, edit=edit_entropy) -> ServedApp:
    """Ingress, SmallModel and two LargeModel replicas (every request goes through session
    affinity), with Ray's metrics exported, through a module's `serve_app` fixture."""
    ray_options = {
        "num_cpus": 4,
        "_metrics_export_port": harness.free_port(),
        "_system_config": {**serve_cli.RAY_SYSTEM_CONFIG, "metrics_report_interval_ms": 500},
    }
    return serve_app(name, models, replicas={"large": 2}, edit=edit, ray_options=ray_options)


def local_engine(served: ServedApp) -> BackoffEngine:
    """The in-process engine over the app's model directories (the reference)."""
    return in_process_engine(served.model_dirs["small"], served.model_dirs["large"])


def reference(
    local: BackoffEngine, prompt, max_tokens, router="entropy", thresholds=(THRESHOLD,), **sampling
) -> GenerationResult:
    """The in-process engine's answer (greedy unless told otherwise)."""
    sampling.setdefault("temperature", 0.0)
    return local.generate(
        GenerationRequest(
            tuple(prompt),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
            RoutingParams(router=router, thresholds=thresholds),
        )
    )


def large_infos() -> dict:
    """LargeModel.info() of every replica of `backoff` (keyed calls spread over replicas by hash)."""
    from ray import serve

    handle = serve.get_deployment_handle("LargeModel", "backoff")
    infos = {}
    for i in range(24):
        info = handle.options(multiplexed_model_id=f"probe-{i}").info.remote().result(timeout_s=30)
        infos[info.replica] = info
    return infos


def router_info():
    """SmallModel.info() of `backoff`."""
    from ray import serve

    return serve.get_deployment_handle("SmallModel", "backoff").info.remote().result(timeout_s=30)
