"""tests/support/tiers.py: every module that starts Ray is in one of the two Ray units of `make
test`'s workers, and nothing else is; the first Ray unit is queued first, the late one last; a
module's other tests stay in its unit."""

from __future__ import annotations

import re

from tests.support.tiers import FIRST_RAY_UNIT, LATE_RAY_UNIT, RAY_UNITS, ROOT, ray_order, starts_ray, unit

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
    assert unit("tests/deployments/test_direct_ingress.py::test_the_replica_serves") == LATE_RAY_UNIT
    assert unit("tests/deployments/test_app_e2e.py::test_http_unary_and_stream") == FIRST_RAY_UNIT
    assert unit("tests/deployments/test_app_input.py::test_x[a::b-c]") == FIRST_RAY_UNIT
    assert unit("tests/deployments/test_multinode.py::test_y") == LATE_RAY_UNIT
    assert unit("tests/backoff_core/test_types.py::test_y[p]") == "tests/backoff_core/test_types.py"
    assert unit("tests/deployments/test_small.py::test_z") == "tests/deployments/test_small.py"
    assert not starts_ray("tests/no_such_module.py")


def test_the_first_ray_unit_is_queued_first_and_the_late_one_last_each_in_its_order():
    """tiers.ray_order: the first unit's tests lead, in RAY_UNITS' order, the late unit's close
    the run; the others keep their order between them (a module's tests keep theirs); every
    Ray module is listed, so the ones sharing a local Ray or an app are placed by someone
    who read their options."""
    from types import SimpleNamespace

    ray_modules = {p.name for p in (ROOT / "tests").rglob("test_*.py") if starts_ray(str(p.relative_to(ROOT)))}
    listed = [m for modules in RAY_UNITS.values() for m in modules]
    assert ray_modules == set(listed) and len(listed) == len(set(listed))
    ids = [
        "tests/test_tiers.py::a",
        "tests/deployments/test_multinode.py::x",
        "tests/deployments/test_multinode.py::y",
        "tests/test_docs.py::b",
        "tests/deployments/test_app_e2e_live.py::e",
        "tests/deployments/test_direct_ingress.py::m",
        "tests/deployments/test_app_load.py::l",
        "tests/deployments/test_app_coalescing.py::z",
        "tests/deployments/test_ray_local.py::r",
        "tests/deployments/test_app_e2e.py::f",
        "tests/test_layout.py::c",
    ]
    ordered = [item.nodeid for item in ray_order([SimpleNamespace(nodeid=i) for i in ids])]
    assert ordered == [
        "tests/deployments/test_app_coalescing.py::z",  # first of the first unit
        "tests/deployments/test_app_e2e.py::f",  # the end-to-end app's three, in their order
        "tests/deployments/test_app_load.py::l",
        "tests/deployments/test_app_e2e_live.py::e",
        "tests/deployments/test_ray_local.py::r",  # last of it
        "tests/test_tiers.py::a",
        "tests/test_docs.py::b",
        "tests/test_layout.py::c",
        "tests/deployments/test_direct_ingress.py::m",  # the late unit, in its order
        "tests/deployments/test_multinode.py::x",
        "tests/deployments/test_multinode.py::y",
    ]


class _Node:
    """What xdist's scheduler asks of a worker: the indexes of the tests it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway = type("Gateway", (), {"id": name})()
        self.shutting_down, self.sent = False, []

    def send_runtest_some(self, indexes) -> None:
        self.sent += list(indexes)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_two_workers_start_on_the_first_ray_unit_and_the_other_modules_and_the_late_unit_waits():
    """Through xdist's own loadscope scheduler (it would queue the largest unit first,
    --loadscope-reorder, and so the late Ray unit early): gw0 gets the first Ray unit whole,
    gw1 the modules without Ray in order, and the late unit is the queue's last."""
    import pytest

    pytest.importorskip("xdist")
    from types import SimpleNamespace

    from tests.support.tiers import scheduler

    values = {"tx": ["2*popen"], "dist": "loadscope"}
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True), getvalue=values.__getitem__)
    sched = scheduler(config, log=None)
    collection = [  # as ray_order leaves it, the late unit the most tests
        *[f"tests/deployments/test_app_coalescing.py::z{i}" for i in range(5)],
        "tests/backoff_core/test_types.py::a",
        "tests/backoff_core/test_types.py::b",
        "tests/test_docs.py::c",
        "tests/test_layout.py::d",
        *[f"tests/deployments/test_multinode.py::t{i}" for i in range(9)],
    ]
    gw0, gw1 = _Node("gw0"), _Node("gw1")
    for node in (gw0, gw1):
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    assert config.option.loadscopereorder is False
    assert [collection[i] for i in gw0.sent] == collection[:5]  # the first Ray unit, alone
    assert [collection[i] for i in gw1.sent] == collection[5:8]  # types (2 tests), then docs
    assert list(sched.workqueue) == ["tests/test_layout.py", LATE_RAY_UNIT]
