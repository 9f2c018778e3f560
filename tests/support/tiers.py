"""The suite's tiers (README, Tests): which tests are slow, and how `make test` spreads modules
over its pytest-xdist workers.

- `slow` marks what takes seconds to minutes; a test marked `ray` (it starts a local Ray and a
  Serve app, or checks that none is up), `real_pair` (it loads the real default pair) or
  `multinode` is slow too (tests/conftest.py adds the mark). `make test-fast` runs `-m "not slow"`.
- Under `--dist loadscope` a unit of work is a module, kept whole so that its module-scoped
  fixtures (a compiled model, a loaded pair, a deployed app) are built once, on one worker;
  every `ray` module is in one unit, so one worker runs them one after another and no two Ray
  instances compete for the cores. The scheduler runs in xdist's controller, which collects
  nothing and sees node ids only, so a module's `ray` mark is read from its source (its
  `pytestmark` line). xdist's own loadgroup cannot do this: it renames node ids through an
  attribute that pytest 9 no longer reads.
- Within the Ray unit the modules run in RAY_ORDER: those that start the same local Ray
  (tests/support/served_app.py's LocalRay: same ray.init options and environment) one after
  another, so they share one instance; a module not listed runs after the listed ones.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPLY_SLOW = ("ray", "real_pair", "multinode")
RAY_UNIT = "ray"
RAY_MODULE = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.ray\b", re.M)
RAY_ORDER = (
    # the default local Ray (served_app.LOCAL_RAY, LOCAL_ENV): one instance for these five
    "test_app_coalescing.py",
    "test_app_eval.py",
    "test_app_faults.py",
    "test_app_load.py",
    "test_app_prefix.py",
    # their own Ray (Ray's metrics read; the dashboard for `serve deploy`), each app shared
    # by its modules (tests/deployments/conftest.py's shared_app)
    "test_app_e2e.py",
    "test_app_e2e_live.py",
    "test_app_input.py",
    "test_app_input_access.py",
    "test_app_input_fuzz.py",
    "test_app_input_sizes.py",
    "test_direct_ingress.py",  # direct ingress: Serve's environment at Ray's start
    "test_multinode.py",  # a cluster of its own
    "test_ray_local.py",
)


@functools.cache
def starts_ray(module: str) -> bool:
    """Whether the module at `module` (a node id's path, from the repository root) is marked `ray`."""
    path = ROOT / module
    return path.suffix == ".py" and path.is_file() and RAY_MODULE.search(path.read_text()) is not None


def unit(nodeid: str) -> str:
    """The unit of work a test belongs to: `ray`, or its module's path."""
    module = nodeid.split("::", 1)[0]
    return RAY_UNIT if starts_ray(module) else module


def ray_order(items: list) -> list:
    """`items` with the Ray modules' tests in RAY_ORDER (stable: a module's tests keep their
    order) in the places the Ray tests held; the other tests stay where they were."""
    ray = [i for i, item in enumerate(items) if starts_ray(item.nodeid.split("::", 1)[0])]

    def rank(item) -> int:
        name = Path(item.nodeid.split("::", 1)[0]).name
        return RAY_ORDER.index(name) if name in RAY_ORDER else len(RAY_ORDER)

    ordered = sorted((items[i] for i in ray), key=rank)
    out = list(items)
    for place, item in zip(ray, ordered, strict=True):
        out[place] = item
    return out


def scheduler(config, log):
    """xdist's loadscope scheduling with `unit` as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndRay(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

    return ModulesAndRay(config, log)
