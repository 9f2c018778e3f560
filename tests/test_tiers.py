"""tests/support/tiers.py: every module that starts Ray is in the one `ray` unit of `make test`'s
workers, and nothing else is; a module's other tests stay in its unit."""

from __future__ import annotations

import re

from tests.support.tiers import RAY_UNIT, ROOT, starts_ray, unit

# what starting Ray looks like in a test module: the app fixtures, a local Ray, a cluster
STARTS_RAY = re.compile(r"\b(serve_app|shared_app|running_app|start_local_ray|start_cluster)\b|\bray\.(init|get)\(")


def modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))


def test_the_modules_that_start_ray_and_only_they_are_the_ray_unit():
    starting = {m for m in modules() if STARTS_RAY.search((ROOT / m).read_text()) and m != "tests/test_tiers.py"}
    marked = {m for m in modules() if starts_ray(m)}
    assert starting == marked
    assert "tests/deployments/test_multinode.py" in marked and "tests/deployments/test_ray_local.py" in marked


def test_a_tests_unit_is_its_module_or_ray():
    assert unit("tests/deployments/test_app_e2e.py::test_http_unary_and_stream") == RAY_UNIT
    assert unit("tests/deployments/test_app_input.py::test_x[a::b-c]") == RAY_UNIT
    assert unit("tests/backoff_core/test_types.py::test_y[p]") == "tests/backoff_core/test_types.py"
    assert unit("tests/deployments/test_small.py::test_z") == "tests/deployments/test_small.py"
    assert not starts_ray("tests/no_such_module.py")


def test_the_ray_modules_run_in_ray_order_and_every_one_is_listed():
    """tiers.ray_order puts the Ray tests in RAY_ORDER in the places they held (the others
    stay put, a module's tests keep their order); every Ray module is in RAY_ORDER, so the
    ones sharing a local Ray are placed by someone who read their options."""
    from types import SimpleNamespace

    from tests.support.tiers import RAY_ORDER, ray_order

    ray_modules = {p.name for p in (ROOT / "tests").rglob("test_*.py") if starts_ray(str(p.relative_to(ROOT)))}
    assert ray_modules == set(RAY_ORDER)
    ids = [
        "tests/test_tiers.py::a",
        "tests/deployments/test_app_e2e.py::x",
        "tests/deployments/test_app_e2e.py::y",
        "tests/test_docs.py::b",
        "tests/deployments/test_app_coalescing.py::z",
    ]
    ordered = [item.nodeid for item in ray_order([SimpleNamespace(nodeid=i) for i in ids])]
    assert ordered == [
        "tests/test_tiers.py::a",
        "tests/deployments/test_app_coalescing.py::z",  # first in RAY_ORDER: the first Ray slot
        "tests/deployments/test_app_e2e.py::x",
        "tests/test_docs.py::b",
        "tests/deployments/test_app_e2e.py::y",
    ]
