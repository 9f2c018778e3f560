"""Tensor-parallel ranks as Ray actors in their replica's placement group, the way Ray Serve LLM
places vLLM's workers (docs/tensor-parallel.md).

A deployment over N ranks (app.with_ranks) asks Serve for a placement group of N bundles per
replica, STRICT_PACK (one node): bundle 0 holds the replica's actor, which is rank 0, and
bundle r holds rank r's actor (`RankActor`, started by `launch_in_placement_group`, the
launcher the replica hands to backoff_core/parallel: that package stays Ray-free). Ray sees
every rank's GPU and CPUs; a rank's process sees its own GPU (cuda:0 in it). The collectives
are still torch.distributed's, over rank 0's TCPStore on loopback: the bundles share a node.

A rank actor is owned by its replica: if the replica exits, Ray ends its ranks; if a rank
dies, its link's answers fail (a dead actor's calls raise), the group breaks (RankFailure) and
the replica exits as a whole (large.lose_replica), to be restarted by Serve with all its ranks.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

if TYPE_CHECKING:  # torch: imported where a rank runs (Serve's app builder imports this module)
    from backoff_core.parallel.launch import Launcher, RankLink
    from backoff_core.parallel.worker import RankSpec

STRATEGY = "STRICT_PACK"  # every rank on the replica's node: NVLink between them, loopback for the store
EMPTY_BUNDLE_CPU = 0.01  # a rank that reserves nothing still needs a non-empty bundle (Ray refuses {})
START_TIMEOUT_S = 600.0  # a rank actor's process starting (torch and transformers imported, on a loaded node)


def rank_bundles(actor: dict, ranks: int) -> list[dict[str, float]]:
    """A replica's placement group from its ray_actor_options: each rank its GPUs and CPUs;
    bundle 0 (the replica's, rank 0) also its custom resources, which pick the node type."""
    rank = {k: float(v) for k, v in (("CPU", actor.get("num_cpus", 1)), ("GPU", actor.get("num_gpus", 0))) if v}
    rank = rank or {"CPU": EMPTY_BUNDLE_CPU}
    return [{**rank, **actor.get("resources", {})}] + [dict(rank) for _ in range(ranks - 1)]


@ray.remote(max_restarts=0)
class RankActor:
    """Rank r >= 1 of a replica's model: worker.py's RankServer behind one actor method, its
    calls run in the order rank 0 made them."""

    def __init__(self, spec: RankSpec, port: int) -> None:
        from backoff_core.parallel.worker import RankServer

        self.server = RankServer(spec, port)

    def where(self) -> tuple[str, int]:
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def handle(self, message: tuple) -> tuple | None:
        return self.server.handle(message)


class ActorLink:
    """A RankLink over a RankActor: each message one actor call, its answer that call's result
    (a dead actor's: an error, read as the rank gone). Alive: its process, on this node."""

    def __init__(self, actor, node: str, pid: int) -> None:
        self.actor, self.node, self.pid = actor, node, pid
        self._answers: collections.deque = collections.deque()
        self._gone = False

    def send(self, message: tuple) -> None:
        if message[0] != "stop":  # "stop" has no answer: join ends the actor
            self._answers.append(self.actor.handle.remote(message))

    def poll(self, timeout_s: float) -> bool:
        ready, _ = ray.wait([self._answers[0]], timeout=timeout_s)
        return bool(ready)

    def recv(self) -> tuple:
        try:
            return ray.get(self._answers.popleft())
        except ray.exceptions.RayError as exc:  # the actor died, or its call raised outside the runner
            self._gone = True
            raise EOFError(f"rank actor gone: {type(exc).__name__}") from exc

    def is_alive(self) -> bool:
        if self._gone:
            return False
        try:
            os.kill(self.pid, 0)  # the same node (STRICT_PACK): a signal-free probe of its process
        except ProcessLookupError:
            self._gone = True
        except PermissionError:
            pass
        return not self._gone

    def kill(self) -> None:
        if not self._gone:
            self._gone = True
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - Ray already down (a replica exiting): its actors went with it
                pass

    def join(self, timeout_s: float) -> None:
        self.kill()


def launch_in_placement_group(spec: RankSpec, port: int) -> list[RankLink]:
    """backoff_core.parallel's Launcher inside a replica that owns a placement group of
    spec.size bundles: rank r's actor in bundle r, on this node."""
    group = get_current_placement_group()
    if group is None or len(group.bundle_specs) < spec.size:
        have = 0 if group is None else len(group.bundle_specs)
        raise RuntimeError(
            f"{spec.name}: {spec.size} ranks need a placement group of {spec.size} bundles, found {have}"
        )
    rank_spec = dataclasses.replace(spec, device="cuda:0") if spec.device.startswith("cuda") else spec
    actors = []
    for rank in range(1, spec.size):
        bundle = group.bundle_specs[rank]
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
        actors.append(
            RankActor.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy
            ).remote(rank_spec, port)
        )
    places = ray.get([a.where.remote() for a in actors], timeout=START_TIMEOUT_S)
    here = ray.get_runtime_context().get_node_id()
    if any(node != here for node, _ in places):
        for actor in actors:
            ray.kill(actor)
        raise RuntimeError(f"{spec.name}: a rank landed off the replica's node (placement strategy not {STRATEGY}?)")
    return [ActorLink(a, node, pid) for a, (node, pid) in zip(actors, places)]


def rank_launcher(ranks: int) -> Launcher:
    """The launcher of a replica over `ranks` ranks: its placement group's actors where Serve
    gave it one (app.with_ranks), else processes of its own (Ray not started: the tests' fakes)."""
    from backoff_core.parallel.launch import spawn_ranks

    if ranks > 1 and ray.is_initialized() and get_current_placement_group() is not None:
        return launch_in_placement_group
    return spawn_ranks
