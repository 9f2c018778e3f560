"""tests/support/ray_local.py: the test process never lets Ray start itself. A Serve handle of
an earlier module may call Ray after its instance went down; that call must fail, not start a
local instance that the next module's `ray.init` then refuses (CI once lost the multi-node
module that way)."""

from __future__ import annotations

import pytest
import ray

from tests.support.ray_local import no_auto_init

# with the modules that start Ray, on the worker that runs them one after another (tests/conftest.py)
pytestmark = pytest.mark.ray


def test_a_ray_call_while_ray_is_down_fails_instead_of_starting_ray():
    ray.shutdown()  # a no-op between modules, where Ray is already down
    no_auto_init()
    with pytest.raises(ray.exceptions.RaySystemError, match="not been started"):
        ray.get(ray.put(1))
    assert not ray.is_initialized()
