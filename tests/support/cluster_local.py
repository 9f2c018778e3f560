"""A Ray cluster of several nodes on one machine (ray.cluster_utils.Cluster), shaped like
cluster.yaml: a head with the CPUs (Serve's controller and proxy, the Ingress replicas)
and GPU nodes that advertise the custom resources the model deployments ask for
(`small_gpu` / `large_gpu`, deployments/app.py replica_options) and one logical GPU each,
so Ray places replicas by GPU and by node type as on a real cluster. The GPU nodes have
no CPUs: a replica that asks for CPUs (the Ingress) can only land on the head.

Nodes are separate raylets with their own worker processes: removing one kills every
replica on it, as losing a machine does. Health checks are fast (the GCS declares a killed
node dead within ~3 s instead of ~30 s), and Serve's autoscaling metrics are pushed every
second (the default 10 s would make a test wait minutes to see a decision).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import ray
from ray.cluster_utils import Cluster

from deployments.serve_cli import RAY_SYSTEM_CONFIG, local_serve_env
from tests.support.ray_local import ATTEMPTS, no_auto_init

FAST_HEALTH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
SERVE_ENV = {
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}
NODE_TYPES = {  # cluster.yaml's node types, scaled down: one logical GPU per model node
    "small_gpu": {"num_cpus": 0, "num_gpus": 1, "resources": {"small_gpu": 1}},
    "large_gpu": {"num_cpus": 0, "num_gpus": 1, "resources": {"large_gpu": 1}},
}


@dataclass
class LocalCluster:
    cluster: Cluster
    nodes: dict[str, list] = field(default_factory=dict)  # node type -> live Node objects
    _env: dict[str, str | None] = field(default_factory=dict)
    node_types: dict[str, dict] = field(default_factory=lambda: dict(NODE_TYPES))

    def add(self, kind: str):
        node = self.cluster.add_node(**self.node_types[kind])
        self.nodes.setdefault(kind, []).append(node)
        return node

    def kill(self, node_id: str) -> str:
        """SIGKILL every process of the node with this Ray node id (a machine lost); its type."""
        for kind, nodes in self.nodes.items():
            for node in nodes:
                if node.node_id == node_id:
                    self.cluster.remove_node(node, allow_graceful=False)
                    nodes.remove(node)
                    return kind
        raise KeyError(f"no worker node {node_id}")

    def kind_of(self, node_id: str) -> str:
        """The node type of a live node: its custom resource, or head."""
        resources = next(n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id)
        return next((k for k in NODE_TYPES if k in resources), "head")

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_cluster(head_cpus: int = 2, gpus: dict[str, int] | None = None, **counts: int) -> LocalCluster:
    """Head + `counts` nodes of each type (e.g. small_gpu=2, large_gpu=2), and connect.
    gpus: logical GPUs a node of a type has, where not one (a tensor-parallel model's node).
    A start that fails (a raylet not registered in time on a loaded machine, as a run beside
    another Ray saw: "The current node timed out during startup") is retried after a pause,
    each failure reported, as ray_local.start_local_ray does."""
    errors = []
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return _start_cluster(head_cpus, gpus, counts)
        except Exception as exc:  # noqa: BLE001 - reported below and on the last attempt
            errors.append(f"attempt {attempt}: {type(exc).__name__}: {exc}")
            print(f"cluster start failed ({errors[-1]})", file=sys.stderr)
            if attempt < ATTEMPTS:
                time.sleep(5.0 * attempt)
    raise RuntimeError("could not start the local cluster:\n" + "\n".join(errors))


def _start_cluster(head_cpus: int, gpus: dict[str, int] | None, counts: dict[str, int]) -> LocalCluster:
    no_auto_init()
    local_serve_env()
    saved = {key: os.environ.get(key) for key in SERVE_ENV}
    os.environ.update(SERVE_ENV)  # the nodes' processes inherit it
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "include_dashboard": False,
            "_system_config": {**RAY_SYSTEM_CONFIG, **FAST_HEALTH},
        },
    )
    types = {kind: {**spec, "num_gpus": (gpus or {}).get(kind, spec["num_gpus"])} for kind, spec in NODE_TYPES.items()}
    local = LocalCluster(cluster, _env=saved, node_types=types)
    try:
        for kind, n in counts.items():
            for _ in range(n):
                local.add(kind)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    except BaseException:
        local.shutdown()
        raise
    return local
