"""`tensor_parallel` in the Serve config and on `backoff serve` (models_config.TensorParallel):
which model gets how many ranks, and what its replica asks Ray for. No Ray started."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.app import build_app, with_ranks
from deployments.serve_cli import DEFAULT_CONFIG, _parser, apply_overrides
from deployments.serving.config import AppArgs
from deployments.serving.models_config import ModelsConfig, TensorParallel


def test_each_level_reads_its_own_size():
    tp = TensorParallel(small=2, large=4, medium=[3])
    assert [tp.size(level, 4) for level in range(4)] == [2, 3, 1, 4]  # the second medium model: unlisted
    assert ModelsConfig().tensor_parallel == TensorParallel()  # 1 rank each by default
    with pytest.raises(ValidationError):
        ModelsConfig(tensor_parallel={"large": 0})
    with pytest.raises(ValidationError):
        ModelsConfig(tensor_parallel={"huge": 2})


def test_backoff_serve_flags_set_the_config():
    import yaml

    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config = apply_overrides(base, _parser().parse_args(["--large-tp", "4", "--small-tp", "2"]))
    models = AppArgs.model_validate(config["applications"][0]["args"]).models
    assert models.tensor_parallel == TensorParallel(small=2, large=4)


def test_a_replica_over_n_ranks_asks_for_n_times_its_gpus_and_cpus():
    options = {"ray_actor_options": {"num_cpus": 1.0, "num_gpus": 1.0}, "max_ongoing_requests": 8}
    assert with_ranks(options, 1) is options
    assert with_ranks(options, 4)["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 4.0}
    app = build_app({"models": {"tensor_parallel": {"large": 4}}, "large": {"gpus": 1, "num_cpus": 2}})
    from ray.serve._private.build_app import build_app as materialize

    large = next(d for d in materialize(app, name="x").deployments if d.name == "LargeModel")
    assert (large.ray_actor_options["num_gpus"], large.ray_actor_options["num_cpus"]) == (4.0, 8.0)
