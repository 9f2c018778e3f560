"""recipes/paper-pair-8gpu: the paper's pair on one 8-GPU node (docs/cluster.md). The Serve
config is valid for Serve and for the app, and places M_S on one GPU and M_L over four; the
cluster.yaml is valid for `ray up` (Ray's own schema) and its GPU node holds the app at its
largest; the KubeRay RayService carries the same Serve config. No Ray started."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

ray_autoscaler = pytest.importorskip("ray.autoscaler")

from ray.serve.schema import ServeDeploySchema  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from backoff_core.parallel.sharding import layout  # noqa: E402
from deployments.app import build_app  # noqa: E402
from deployments.serving.config import AppArgs  # noqa: E402

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "paper-pair-8gpu"
LLAMA_70B = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8)


def _serve() -> dict:
    return yaml.safe_load((RECIPE / "serve_config.yaml").read_text())


def _deployments(config: dict) -> dict:
    from ray.serve._private.build_app import build_app as materialize

    app = build_app(config["applications"][0]["args"])
    return {d.name: d for d in materialize(app, name="backoff").deployments}


def test_the_serve_config_places_m_s_on_one_gpu_and_m_l_on_four():
    config = _serve()
    ServeDeploySchema.model_validate(config)
    args = AppArgs.model_validate(config["applications"][0]["args"])
    assert args.models.tensor_parallel.large == 4 and args.models.tensor_parallel.small == 1
    lay = layout(LLAMA_70B, "large", 4)
    assert (lay.heads_per_rank, lay.kv_per_rank) == (16, 2)
    d = _deployments(config)
    large = d["LargeModel"]._replica_config  # a placement group of 4 one-GPU bundles, one node
    assert large.placement_group_bundles == [{"CPU": 2.0, "GPU": 1.0}] * 4
    assert large.placement_group_strategy == "STRICT_PACK" and large.ray_actor_options["num_gpus"] == 1.0
    small = d["SmallModel"].ray_actor_options
    assert small["num_gpus"] == 1.0 and d["SmallModel"]._replica_config.placement_group_bundles is None
    most = args.large.max_replicas * 4 + args.small.max_replicas * small["num_gpus"]
    assert most <= 8  # the app at its largest on one 8-GPU node


def test_the_cluster_yaml_is_valid_for_ray_up_and_its_node_holds_the_app():
    schema = json.loads((Path(ray_autoscaler.__file__).parent / "ray-schema.json").read_text())
    cluster = yaml.safe_load((RECIPE / "cluster.yaml").read_text())
    jsonschema.validate(cluster, schema)
    node = cluster["available_node_types"]["gpu_node"]
    assert node["resources"]["GPU"] == 8 and node["min_workers"] == 1


def test_the_rayservice_carries_the_same_serve_config():
    manifest = yaml.safe_load((RECIPE / "rayservice.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    expected = _serve()
    expected["http_options"]["host"] = "0.0.0.0"  # in a pod, behind its Service
    assert served == expected
    (workers,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = workers["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8" and workers["rayStartParams"]["num-gpus"] == "8"
