"""The application builder: `import_path: deployments.app:build_app` in a Serve config.

Binds Ingress -> SmallModel -> one LargeModel-like deployment per larger level (a chain of
three models adds `MediumModel1`). Callers pick a SmallModel replica by prompt prefix
(prefix_routing.py, `prefix_routing` in AppArgs), a LargeModel one by session (affinity.py).
Scaling and resources come from `AppArgs`: the custom resources of cluster.yaml (small_gpu /
large_gpu) where the cluster has them, else shares of whatever GPUs it has (two models on one
GPU: half each), zero GPUs on a CPU-only cluster.
"""

from __future__ import annotations

import ray
from ray.serve import Application
from ray.serve.config import BackpressureConfig

from deployments.ingress import Ingress
from deployments.large import LargeModel
from deployments.prefix_routing import prefix_router_config
from deployments.rank_actors import STRATEGY, rank_bundles
from deployments.serving.config import AppArgs, ReplicaConfig
from deployments.small import SmallModel

# serve_cli.SERVE_PATH_ENV runs a replica's handle router on its main event loop; the
# SmallModel's step thread waits on its catch-up calls with a blocking `.result()`, which
# Serve refuses unless that router has a loop of its own: its replicas keep one.
SMALL_MODEL_ENV = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}


def message_env(cfg: AppArgs) -> dict[str, str]:
    """Every replica's receive limit on Serve's gRPC channels (read at import, so set in its
    runtime_env): a replica's server (calls to it) and its handles' channels (their replies)."""
    return {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(cfg.max_message_bytes)}


def level_deployment_name(level: int, num_levels: int) -> str:
    return "LargeModel" if level == num_levels - 1 else f"MediumModel{level}"


def _cluster_resources() -> dict[str, float]:
    return ray.cluster_resources() if ray.is_initialized() else {}


def replica_options(
    rc: ReplicaConfig, cluster: dict[str, float], models: int = 2, retry_after_s: float | None = None
) -> dict:
    """Deployment.options(...) kwargs: scaling, concurrency, bounded queues and placement.
    `gpus: auto` is a whole GPU on a node type of its own (cluster.yaml), else a share of
    the cluster's GPUs such that one replica of each of the `models` model deployments
    fits, else 0. A caller over max_queued_requests gets 503 with `retry_after_s`."""
    dedicated = bool(rc.custom_resource) and cluster.get(rc.custom_resource, 0) > 0
    if rc.gpus == "none":
        gpus = 0.0
    elif rc.gpus == "auto":
        gpus = 1.0 if dedicated and cluster.get("GPU", 0) > 0 else min(1.0, cluster.get("GPU", 0) / models)
    else:
        gpus = float(rc.gpus)
    actor: dict = {"num_cpus": rc.num_cpus, "num_gpus": gpus}
    if dedicated:
        actor["resources"] = {rc.custom_resource: 1}
    options: dict = {"ray_actor_options": actor, "max_ongoing_requests": rc.max_ongoing_requests}
    if rc.max_queued_requests is not None:
        options["max_queued_requests"] = rc.max_queued_requests
        options["backpressure_config"] = BackpressureConfig(retry_after_s=retry_after_s)
    if rc.num_replicas is not None:
        options["num_replicas"] = rc.num_replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": rc.min_replicas,
            "max_replicas": rc.max_replicas,
            "target_ongoing_requests": rc.target_ongoing_requests,
        }
    return options


def with_ranks(options: dict, ranks: int) -> dict:
    """A replica over `ranks` tensor-parallel ranks (backoff_core/parallel): a placement group
    of `ranks` bundles on one node (STRICT_PACK), each the GPUs and CPUs of the actor options
    (a rank's); the replica, rank 0, in bundle 0 with the custom resources, ranks 1.. as Ray
    actors in the others (rank_actors.py), as Ray Serve LLM places vLLM's workers."""
    if ranks <= 1:
        return options
    bundles = rank_bundles(options["ray_actor_options"], ranks)
    return {**options, "placement_group_bundles": bundles, "placement_group_strategy": STRATEGY}


def build_app(args: dict | AppArgs | None = None) -> Application:
    cfg = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    cluster = _cluster_resources()
    models, n = cfg.models.model_dump(), cfg.models.num_levels
    env = message_env(cfg)

    def large(level: int) -> dict:
        options = replica_options(cfg.large, cluster, n)
        options["ray_actor_options"]["runtime_env"] = {"env_vars": env}
        return with_ranks(options, cfg.models.tensor_parallel.size(level, n))

    levels = [
        LargeModel.options(
            name=level_deployment_name(level, n), user_config=cfg.catch_up.model_dump(), **large(level)
        ).bind(models, level, cfg.torch_threads)
        for level in range(1, n)
    ]
    retry = cfg.admission.retry_after_s
    small = replica_options(cfg.small, cluster, n, retry)
    small["ray_actor_options"]["runtime_env"] = {"env_vars": {**SMALL_MODEL_ENV, **env}}
    if (prefix := prefix_router_config(cfg.prefix_routing)) is not None:  # else Serve's power of two choices
        small["request_router_config"] = prefix
    small = with_ranks(small, cfg.models.tensor_parallel.small)
    router = SmallModel.options(user_config=cfg.routing.model_dump(), **small).bind(cfg.model_dump(), *levels)
    ingress = replica_options(cfg.ingress, cluster, retry_after_s=retry)
    ingress["ray_actor_options"]["runtime_env"] = {"env_vars": env}
    return Ingress.options(**ingress).bind(router, cfg.model_dump())
