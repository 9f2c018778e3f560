"""Fixtures of tests/deployments/serving (the Ray-free serving parts)."""

from __future__ import annotations

import pytest

from tests.support.remote_fakes import LoopThread


@pytest.fixture(scope="module")
def loop_thread():
    """A replica's event loop on a thread, for the module's batchers and fake endpoints."""
    lt = LoopThread()
    yield lt
    lt.stop()
