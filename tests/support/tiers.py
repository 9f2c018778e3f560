"""The suite's tiers (README, Tests): which tests are slow, and how `make test` spreads modules
over its pytest-xdist workers.

- `slow` marks what takes seconds to minutes; a test marked `ray` (it starts a local Ray and a
  Serve app, or checks that none is up), `real_pair` (it loads the real default pair) or
  `multinode` is slow too (tests/conftest.py adds the mark). `make test-fast` runs `-m "not slow"`.
- Under `--dist loadscope` a unit of work is a module, kept whole so that its module-scoped
  fixtures (a compiled model, a loaded pair, a deployed app) are built once, on one worker.
  The `ray` modules form RAY_UNITS' two units instead: one worker runs a unit's modules one
  after another, so a worker never holds two Ray instances, and consecutive modules share
  what they can (below). The first unit is the queue's first: it starts at once, beside the
  modules without Ray on the other worker; the second is the queue's last, so that worker
  takes it once those modules are done, and the two Ray units overlap only at the end
  (one Ray unit left the other worker idle for two thirds of the run). The scheduler runs in
  xdist's controller, which collects nothing and sees node ids only, so a module's `ray` mark
  is read from its source (its `pytestmark` line), and the queue keeps the collection's order
  (tests/conftest.py: `ray_order`), not xdist's largest-unit-first. xdist's own loadgroup
  cannot do this: it renames node ids through an attribute that pytest 9 no longer reads.
- Within a Ray unit the modules run in the order listed: those that start the same local Ray
  (tests/support/served_app.py's LocalRay: same ray.init options and environment) one after
  another, so they share one instance, and those that share an app (tests/deployments/
  conftest.py's shared_app) likewise.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPLY_SLOW = ("ray", "real_pair", "multinode")
RAY_MODULE = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.ray\b", re.M)
RAY_UNITS: dict[str, tuple[str, ...]] = {
    "ray": (
        # the default local Ray (served_app.LOCAL_RAY, LOCAL_ENV): one instance for these four
        "test_app_coalescing.py",
        "test_app_eval.py",
        "test_app_faults.py",
        "test_app_prefix.py",
        # a Ray of their own (Ray's metrics read; the dashboard for `serve deploy`), one app
        # for the four (tests/deployments/conftest.py's shared_app)
        "test_app_input.py",
        "test_app_input_access.py",
        "test_app_input_fuzz.py",
        "test_app_input_sizes.py",
        # a Ray of their own (Ray's metrics read), one app for the three (e2e_app.py), its
        # live changes last
        "test_app_e2e.py",
        "test_app_load.py",
        "test_app_e2e_live.py",
        "test_ray_local.py",
    ),
    # ~340 s, so that the other worker (~660 s of modules without Ray first) ends with the first
    # unit. A run of 2,143 test-seconds with prefix routing here too (its Ray started again,
    # beside the first unit's: its setup 122 s against 21 s alone): the first unit ~1,010 s,
    # the other worker ~1,130 s
    "ray-late": (
        "test_direct_ingress.py",  # direct ingress: Serve's environment at Ray's start
        "test_multinode.py",  # a cluster of its own
    ),
}
RAY_UNIT_OF = {module: name for name, modules in RAY_UNITS.items() for module in modules}
FIRST_RAY_UNIT, LATE_RAY_UNIT = RAY_UNITS


@functools.cache
def starts_ray(module: str) -> bool:
    """Whether the module at `module` (a node id's path, from the repository root) is marked `ray`."""
    path = ROOT / module
    return path.suffix == ".py" and path.is_file() and RAY_MODULE.search(path.read_text()) is not None


def unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its RAY_UNITS unit (`ray` for a Ray module not
    listed), or its module's path."""
    module = nodeid.split("::", 1)[0]
    return RAY_UNIT_OF.get(Path(module).name, FIRST_RAY_UNIT) if starts_ray(module) else module


def ray_order(items: list) -> list:
    """`items` with the first Ray unit's tests first and the last one's last, each unit's
    modules in RAY_UNITS' order (stable: a module's tests keep their order); the other tests
    keep theirs, between them."""

    def place(item) -> tuple[int, int]:
        module = item.nodeid.split("::", 1)[0]
        if not starts_ray(module):
            return (1, 0)
        name = Path(module).name
        modules = RAY_UNITS[unit(module)]
        first = unit(module) == FIRST_RAY_UNIT
        return (0 if first else 2, modules.index(name) if name in modules else len(modules))

    return sorted(items, key=place)


def scheduler(config, log):
    """xdist's loadscope scheduling with `unit` as the scope, its queue in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndRay(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

    config.option.loadscopereorder = False  # ray_order's order: the late Ray unit last
    return ModulesAndRay(config, log)
