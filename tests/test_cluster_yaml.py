"""cluster.yaml against Ray's own cluster-config schema (ray/autoscaler/ray-schema.json, the
one `ray up` validates with), and against what the Serve app asks of it: the node types
name the custom resources of the model deployments (deployments/serving/config.py), one GPU each."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

ray_autoscaler = pytest.importorskip("ray.autoscaler")

from deployments.serving.config import AppArgs  # noqa: E402

CLUSTER_YAML = Path(__file__).resolve().parent.parent / "cluster.yaml"


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((Path(ray_autoscaler.__file__).parent / "ray-schema.json").read_text())


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_cluster_yaml_is_valid_for_ray(cluster, schema):
    jsonschema.validate(cluster, schema)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c["available_node_types"]["small_gpu"].update(resource={"GPU": 1}),  # a misspelt key
        lambda c: c["available_node_types"]["large_gpu"].update(max_workers="four"),  # a wrong type
        lambda c: c.pop("provider"),  # a required section
    ],
)
def test_the_schema_catches_a_broken_cluster_yaml(cluster, schema, mutate):
    broken = copy.deepcopy(cluster)
    mutate(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_node_types_carry_what_the_model_deployments_ask_for(cluster):
    args = AppArgs()
    types = cluster["available_node_types"]
    for part in (args.small, args.large):
        kind = part.custom_resource
        assert kind in types, f"no node type for {kind}"
        resources = types[kind]["resources"]
        assert resources.get(kind) == 1 and resources.get("GPU") == 1  # one replica, one GPU per node
        assert types[kind]["min_workers"] >= 1  # a model replica can always be placed
    head = types[cluster["head_node_type"]]["resources"]
    assert head.get("GPU", 0) == 0 and head.get("CPU", 0) >= 1  # the Ingress and Serve's proxy


def test_every_node_starts_ray_with_serves_fast_path_env(cluster):
    from deployments.serve_cli import SERVE_PATH_ENV

    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = next(c for c in cluster[key] if "ray start" in c)
        assignments = start.split("ray start")[0].split()
        assert dict(a.split("=", 1) for a in assignments) == SERVE_PATH_ENV, key
