"""What the cluster recipes are checked against, without a cluster: Ray's own cluster-config
schema (the one `ray up` validates with), the fields KubeRay's RayService CRD requires, and the
versions CI tests (tests/test_recipes*.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"

# KubeRay's RayService CRD, ray.io/v1 (helm-chart/kuberay-operator/crds/ray.io_rayservices.yaml,
# KubeRay master of 2026-08): the fields its openAPIV3Schema requires, by path ([] = each item;
# a leading * = under any parent), and the properties it knows where a misspelling would be
# dropped silently by a lenient apply.
CRD_REQUIRED = {
    "spec": ("rayClusterConfig",),
    "spec.rayClusterConfig": ("headGroupSpec",),
    "spec.rayClusterConfig.headGroupSpec": ("template",),
    "spec.rayClusterConfig.headGroupSpec.template.spec": ("containers",),
    "spec.rayClusterConfig.workerGroupSpecs[]": ("groupName", "maxReplicas", "minReplicas", "template"),
    "spec.rayClusterConfig.workerGroupSpecs[].template.spec": ("containers",),
    "*.containers[]": ("name",),
    "*.initContainers[]": ("name",),
    "*.env[]": ("name",),
    "*.ports[]": ("containerPort",),
    "*.volumeMounts[]": ("mountPath", "name"),
    "*.volumes[]": ("name",),
    "*.persistentVolumeClaim": ("claimName",),
}
CRD_KNOWN = {
    "spec": {
        "deploymentUnhealthySecondThreshold", "excludeHeadPodFromServeSvc", "managedBy", "rayClusterConfig",
        "rayClusterDeletionDelaySeconds", "serveConfigV2", "serveService", "serviceUnhealthySecondThreshold",
        "suspend", "upgradeStrategy",
    },
    "spec.rayClusterConfig": {
        "authOptions", "autoscalerOptions", "enableInTreeAutoscaling", "gcsFaultToleranceOptions", "headGroupSpec",
        "headServiceAnnotations", "historyServerOptions", "managedBy", "networkPolicy", "rayVersion", "suspend",
        "tlsOptions", "upgradeStrategy", "workerGroupSpecs",
    },
    "spec.rayClusterConfig.headGroupSpec": {
        "enableIngress", "headService", "ingressOptions", "labels", "rayStartParams", "resources", "serviceType",
        "template",
    },
    "spec.rayClusterConfig.workerGroupSpecs[]": {
        "groupName", "idleTimeoutSeconds", "labels", "maxReplicas", "minReplicas", "numOfHosts", "priority",
        "rayStartParams", "replicas", "resources", "scaleStrategy", "suspend", "template",
    },
}  # fmt: skip
CRD_STRINGS = ("spec.serveConfigV2", "*.rayStartParams.*", "spec.rayClusterConfig.rayVersion")


def _walk(node, path: str):
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}" if path else key)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item, f"{path}[]")


def _matches(pattern: str, path: str) -> bool:
    regex = re.escape(pattern).replace(r"\*", r"\S*")
    return re.fullmatch(regex, path) is not None


def crd_problems(manifest: dict) -> list[str]:
    """What KubeRay's RayService CRD would refuse in `manifest` (nothing: [])."""
    problems = []
    if (manifest.get("apiVersion"), manifest.get("kind")) != ("ray.io/v1", "RayService"):
        problems.append("not a ray.io/v1 RayService")
    for path, node in _walk(manifest, ""):
        for pattern, keys in CRD_REQUIRED.items():
            if _matches(pattern, path):
                problems += [f"{path}: no {k}" for k in keys if not isinstance(node, dict) or k not in node]
        if path in CRD_KNOWN and isinstance(node, dict):
            problems += [f"{path}: unknown field {k}" for k in set(node) - CRD_KNOWN[path]]
        if any(_matches(p, path) for p in CRD_STRINGS) and not isinstance(node, str):
            problems.append(f"{path}: {node!r} is not a string")
    return problems


def ray_cluster_schema() -> dict:
    """Ray's cluster-config schema, as `ray up` validates with it."""
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def ci_versions() -> dict[str, str]:
    """The versions CI tests: the Makefile's torch pin, the Ray of the venv it installs."""
    import ray

    return {"torch": re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1), "ray": ray.__version__}
