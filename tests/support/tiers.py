"""The suite's tiers (README, Tests): which tests are slow, and how `make test` spreads modules
over its pytest-xdist workers.

- `slow` marks what takes seconds to minutes; a test marked `ray` (it starts a local Ray and a
  Serve app, or checks that none is up), `real_pair` (it loads the real default pair) or
  `multinode` is slow too (tests/conftest.py adds the mark). `make test-fast` runs `-m "not slow"`.
- Under `--dist loadscope` a unit of work is a module, kept whole so that its module-scoped
  fixtures (a compiled model, a loaded pair, a deployed app) are built once, on one worker.
  The `ray` modules form two units, each run by one worker one module after another, so at
  most two Ray instances run at once and modules that share a deployed app stay in order:
  `ray`, the apps whose tests check answers and admission, and `ray-faults`, the modules
  that kill replicas or nodes and the bad-input app's (a module says `RAY_UNIT =
  "ray-faults"`), so that the two take about as long. Much of a Ray module's time is
  waiting (replicas starting, Serve's control loop, timeouts), so the two units overlap on
  two cores; both are handed out first, and the other modules fill the workers around them
  (`make test` runs three).
- The scheduler runs in xdist's controller, which collects nothing and sees node ids only, so
  a module's `ray` mark and unit are read from its source (its `pytestmark` and `RAY_UNIT`
  lines). xdist's own loadgroup cannot do this: it renames node ids through an attribute
  that pytest 9 no longer reads.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPLY_SLOW = ("ray", "real_pair", "multinode")
RAY_UNIT = "ray"
FAULTS_UNIT = "ray-faults"
RAY_UNITS = (FAULTS_UNIT, RAY_UNIT)  # handed out first, in this order
RAY_MODULE = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.ray\b", re.M)
UNIT_LINE = re.compile(r'^RAY_UNIT\s*=\s*"([\w-]+)"', re.M)


@functools.cache
def starts_ray(module: str) -> bool:
    """Whether the module at `module` (a node id's path, from the repository root) is marked `ray`."""
    path = ROOT / module
    return path.suffix == ".py" and path.is_file() and RAY_MODULE.search(path.read_text()) is not None


@functools.cache
def ray_unit(module: str) -> str | None:
    """The Ray unit of a `ray` module (its RAY_UNIT line, else `ray`); None for other modules."""
    if not starts_ray(module):
        return None
    named = UNIT_LINE.search((ROOT / module).read_text())
    unit = named.group(1) if named else RAY_UNIT
    if unit not in RAY_UNITS:
        raise ValueError(f"{module}: RAY_UNIT {unit!r} is none of {RAY_UNITS}")
    return unit


def unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its Ray unit, or its module's path."""
    module = nodeid.split("::", 1)[0]
    return ray_unit(module) or module


def scheduler(config, log):
    """xdist's loadscope scheduling with `unit` as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndRay(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            # the Ray units are the longest chains: they start first, on workers of their own
            for scope in reversed(RAY_UNITS):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ModulesAndRay(config, log)
