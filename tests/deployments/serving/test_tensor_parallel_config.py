"""`tensor_parallel` in the Serve config and on `backoff serve` (models_config.TensorParallel):
which model gets how many ranks, what its replica asks Ray for (a placement group), and how it
reads its rank actors (deployments/rank_actors.py). No Ray started."""

from __future__ import annotations

import os

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


def test_a_replica_over_n_ranks_owns_a_placement_group_of_n_bundles_on_one_node():
    options = {"ray_actor_options": {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"large_gpu": 1}}}
    assert with_ranks(options, 1) is options
    tp = with_ranks(options, 3)
    assert tp["placement_group_strategy"] == "STRICT_PACK" and tp["ray_actor_options"] == options["ray_actor_options"]
    # bundle 0: the replica (rank 0) with the node type's resource; 1, 2: a rank actor each
    assert tp["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0, "large_gpu": 1}] + [{"CPU": 1.0, "GPU": 1.0}] * 2
    nothing = {"ray_actor_options": {"num_cpus": 0, "num_gpus": 0}}  # Ray refuses an empty bundle
    assert with_ranks(nothing, 2)["placement_group_bundles"] == [{"CPU": 0.01}] * 2


def test_the_app_gives_the_split_models_their_placement_groups():
    app = build_app(
        {
            "models": {"tensor_parallel": {"large": 4, "small": 2}},
            "large": {"gpus": 1, "num_cpus": 2},
            "small": {"gpus": 0},
        }
    )
    from ray.serve._private.build_app import build_app as materialize

    placed = {d.name: d._replica_config for d in materialize(app, name="x").deployments}
    large, small = placed["LargeModel"], placed["SmallModel"]
    assert large.placement_group_bundles == [{"CPU": 2.0, "GPU": 1.0}] * 4
    assert large.placement_group_strategy == "STRICT_PACK"
    assert (large.ray_actor_options["num_gpus"], large.ray_actor_options["num_cpus"]) == (1.0, 2.0)  # a rank's
    assert small.placement_group_bundles == [{"CPU": 1.0}] * 2
    assert placed["Ingress"].placement_group_bundles is None


def test_a_replica_in_a_placement_group_launches_its_ranks_as_actors_in_it(monkeypatch):
    from backoff_core.parallel.launch import spawn_ranks
    from deployments import rank_actors

    assert rank_actors.rank_launcher(3) is spawn_ranks  # Ray not started: processes of its own (the fakes)
    monkeypatch.setattr(rank_actors.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(rank_actors, "get_current_placement_group", lambda: object())
    assert rank_actors.rank_launcher(3) is rank_actors.launch_in_placement_group
    assert rank_actors.rank_launcher(1) is spawn_ranks


def test_a_rank_actor_reads_as_gone_when_its_process_is_or_its_call_failed(monkeypatch):
    """What makes the replica's health check fail between calls (the process probed on its
    node) and a catch-up in flight raise RankFailure (a dead actor's answer: EOFError)."""
    import subprocess

    import ray

    from deployments import rank_actors

    proc = subprocess.Popen(["sleep", "60"])
    link = rank_actors.ActorLink(actor=None, node="node-0", pid=proc.pid)
    assert link.is_alive()
    proc.kill()
    proc.wait()
    assert not link.is_alive()

    class Died:  # a RankActor's handle whose process died: its calls' results raise
        handle = type("Method", (), {"remote": staticmethod(lambda message: "ref")})

    def get(ref):
        raise ray.exceptions.RayActorError()

    monkeypatch.setattr(rank_actors.ray, "get", get)
    link = rank_actors.ActorLink(Died(), "node-0", pid=os.getpid())
    link.send(("extend", ([("a", [1])],), {}))
    link.send(("stop", (), {}))  # no answer expected: not sent
    with pytest.raises(EOFError, match="rank actor gone"):
        link.recv()
    assert not link.is_alive() and not link._answers
