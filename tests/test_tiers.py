"""tests/support/tiers.py: every module that starts Ray is in one of the two Ray units of `make
test`'s workers, and nothing else is; modules that share a deployed app share a unit; a
module's other tests stay in its unit; the Ray units are handed out first."""

from __future__ import annotations

import re
import types

import pytest

from tests.support.tiers import FAULTS_UNIT, RAY_UNIT, RAY_UNITS, ROOT, ray_unit, scheduler, starts_ray, unit

# what starting Ray looks like in a test module: the app fixtures, a local Ray, a cluster
STARTS_RAY = re.compile(r"\b(serve_app|shared_app|running_app|start_local_ray|start_cluster)\b|\bray\.(init|get)\(")


def modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))


def test_the_modules_that_start_ray_and_only_they_are_the_ray_unit():
    starting = {m for m in modules() if STARTS_RAY.search((ROOT / m).read_text()) and m != "tests/test_tiers.py"}
    marked = {m for m in modules() if starts_ray(m)}
    assert starting == marked
    assert "tests/deployments/test_multinode.py" in marked and "tests/deployments/test_ray_local.py" in marked


def test_a_tests_unit_is_its_module_or_its_ray_unit():
    assert unit("tests/deployments/test_app_e2e.py::test_http_unary_and_stream") == RAY_UNIT
    assert unit("tests/deployments/test_app_input.py::test_x[a::b-c]") == FAULTS_UNIT
    assert unit("tests/deployments/test_app_load.py::test_x") == RAY_UNIT
    assert unit("tests/deployments/test_multinode.py::test_autoscaling_follows_a_burst") == FAULTS_UNIT
    assert unit("tests/deployments/test_app_faults.py::test_x") == FAULTS_UNIT
    assert unit("tests/backoff_core/test_types.py::test_y[p]") == "tests/backoff_core/test_types.py"
    assert unit("tests/deployments/test_small.py::test_z") == "tests/deployments/test_small.py"
    assert not starts_ray("tests/no_such_module.py")


def test_modules_that_share_an_app_share_a_ray_unit():
    """A shared app (SHARED_APP) is deployed once for consecutive modules of one worker."""
    shared: dict[str, set[str]] = {}
    for m in modules():
        key = re.search(r"^SHARED_APP\s*=\s*(\S+)", (ROOT / m).read_text(), re.M)
        if key:
            shared.setdefault(key.group(1), set()).add(ray_unit(m))
    assert len(shared) >= 2 and all(len(units) == 1 and None not in units for units in shared.values()), shared


def test_the_ray_units_are_handed_out_first():
    """Before any module, whatever the queue's order (xdist sorts it by size)."""
    pytest.importorskip("xdist")
    sent: list[list[int]] = []

    class Node:
        def send_runtest_some(self, indexes):
            sent.append(indexes)

    config = types.SimpleNamespace(option=types.SimpleNamespace(), getvalue={"tx": ["3*popen"]}.get)
    sched = scheduler(config, None)
    ids = ["tests/a/test_big.py::t" + str(i) for i in range(5)] + [
        "tests/deployments/test_app_e2e.py::t",
        "tests/deployments/test_multinode.py::t",
    ]
    sched.workqueue.update((unit(i), {i: False}) for i in ids)
    nodes = [Node() for _ in range(3)]
    for node in nodes:
        sched.registered_collections[node] = ids
        sched._assign_work_unit(node)
    assert [sched.assigned_work[n].popitem()[0] for n in nodes] == [*RAY_UNITS, "tests/a/test_big.py"]
