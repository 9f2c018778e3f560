"""The general cluster recipe (docs/cluster.md, "Recipe: a GPU pair on a cluster"): the top-level
cluster.yaml and recipes/gpu-pair/ (its Serve config, its KubeRay RayService). The Serve config
loads with the app's config models and serves a pair in bf16 on every interface; cluster.yaml is
valid for `ray up`, carries that config to every node, pins the Ray and torch CI tests and
fetches the weights on every GPU node; every RayService has what KubeRay's CRD requires and the
gpu-pair one is what `python -m deployments.serving.recipe rayservice` writes from its Serve
config, for other models too. No Ray started."""

from __future__ import annotations

import jsonschema
import pytest
import yaml

pytest.importorskip("ray.autoscaler")

from ray.serve.schema import ServeDeploySchema  # noqa: E402

from deployments import serve_cli  # noqa: E402
from deployments.serving import recipe  # noqa: E402
from deployments.serving.config import AppArgs  # noqa: E402
from tests.support.recipes import RECIPES, ROOT, ci_versions, crd_problems, ray_cluster_schema  # noqa: E402

GPU_PAIR = RECIPES / "gpu-pair"
CLUSTERS = [ROOT / "cluster.yaml", RECIPES / "paper-pair-8gpu" / "cluster.yaml"]
RAYSERVICES = [GPU_PAIR / "rayservice.yaml", RECIPES / "paper-pair-8gpu" / "rayservice.yaml"]


def _load(path) -> dict:
    return yaml.safe_load(path.read_text())


def _served(config: dict) -> AppArgs:
    ServeDeploySchema.model_validate(config)
    return AppArgs.model_validate(config["applications"][0]["args"])


def test_the_gpu_pair_is_served_in_bf16_on_every_interface_on_the_cluster_yamls_node_types():
    config = _load(GPU_PAIR / "serve_config.yaml")
    args = _served(config)
    assert args.models.dtype == "bfloat16" and config["http_options"]["host"] == "0.0.0.0"
    assert all(recipe.HF_ID.match(m) for m in recipe.models_of(config))  # ids: fetched on every node
    types = _load(ROOT / "cluster.yaml")["available_node_types"]
    for part in (args.small, args.large):
        assert types[part.custom_resource]["resources"][part.custom_resource] == 1
        assert part.max_replicas <= types[part.custom_resource]["max_workers"]


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.parent.name)
def test_every_cluster_yaml_is_valid_for_ray_up_and_pins_the_versions_ci_tests(path):
    cluster = _load(path)
    jsonschema.validate(cluster, ray_cluster_schema())
    setup = " ".join(cluster["setup_commands"])
    pins = ci_versions()
    assert f"torch=={pins['torch']}" in setup and f"'ray[serve]=={pins['ray']}'" in setup, setup


def test_cluster_yaml_carries_the_gpu_pair_config_and_fetches_its_weights_on_every_gpu_node():
    cluster = _load(ROOT / "cluster.yaml")
    source = cluster["file_mounts"]["~/serve_config.yaml"]
    assert (ROOT / source).resolve() == (GPU_PAIR / "serve_config.yaml").resolve()
    (fetch,) = [c for c in cluster["worker_setup_commands"] if "deployments.serving.recipe weights" in c]
    assert fetch.split("recipe weights ")[1].split()[0] == "~/serve_config.yaml"
    assert "head_setup_commands" not in cluster  # the head holds no model
    assert "127.0.0.1" not in (ROOT / "cluster.yaml").read_text()


@pytest.mark.parametrize("path", RAYSERVICES, ids=lambda p: p.parent.name)
def test_every_rayservice_has_what_the_crd_requires_and_a_serve_config_the_app_loads(path):
    manifest = _load(path)
    assert crd_problems(manifest) == []
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    _served(config)
    assert config["http_options"]["host"] == "0.0.0.0"  # in a pod, behind its Service
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == ci_versions()["ray"]


def test_the_gpu_pair_rayservice_is_what_the_recipe_writes_from_its_serve_config():
    manifest = _load(GPU_PAIR / "rayservice.yaml")
    config = _load(GPU_PAIR / "serve_config.yaml")
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"]) == config
    assert recipe.rayservice(config, manifest) == manifest
    groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for group in groups:  # every GPU pod fetches the weights before Ray starts in it
        (init,) = group["template"]["spec"]["initContainers"]
        assert init["command"][-4:] == ["--model", recipe.models_of(config)[0], "--model", recipe.models_of(config)[1]]
    resources = {g["groupName"]: g["rayStartParams"]["resources"] for g in groups}
    assert resources == {"small-gpu": '"{\\"small_gpu\\": 1}"', "large-gpu": '"{\\"large_gpu\\": 1}"'}


def test_other_models_fill_in_with_the_documented_commands(tmp_path, capsys):
    """`backoff serve --print-config --config recipes/gpu-pair/serve_config.yaml --small ...
    --large ...` writes the Serve config; `recipe rayservice` the manifest carrying it."""
    argv = ["--config", str(GPU_PAIR / "serve_config.yaml"), "--small", "/shared/m-s", "--large", "org/m-l"]
    assert serve_cli.main([*argv, "--print-config"]) == 0
    mine = tmp_path / "my-pair.yaml"
    mine.write_text(capsys.readouterr().out)
    args = _served(_load(mine))
    assert (args.models.small, args.models.large, args.models.dtype) == ("/shared/m-s", "org/m-l", "bfloat16")
    assert recipe.main(["rayservice", str(mine)]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    assert crd_problems(manifest) == [] and yaml.safe_load(manifest["spec"]["serveConfigV2"]) == _load(mine)
    for group in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        command = group["template"]["spec"]["initContainers"][0]["command"]
        assert command == [*recipe.WEIGHTS_COMMAND, "--model", "/shared/m-s", "--model", "org/m-l"]
