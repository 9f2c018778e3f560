"""Fixtures every level uses: the tiny tokenizer and pair (random models built in-process);
the default pair lives in tests of its own. Level-specific fixtures are in the conftest.py of
their level (tests/backoff_core, tests/deployments, tests/deployments/serving)."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

# MKL may use fewer threads than asked when the machine is busy (MKL_DYNAMIC), which changes
# how a matmul's sums are split and so the last bits of its result: a near-tie between two
# tokens in an equivalence test may then flip with the load. Fixed threads, fixed bits.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
import torch  # noqa: E402

# Under pytest-xdist (`make test` runs two workers on CI's two cores) each worker computes on
# one thread, so that two workers share the cores instead of fighting over them.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // WORKERS))

# The converted-model cache (backoff_core/models/gguf_cache.py) of test runs: never the
# user's, and one per machine so that every run (and the CLI / Ray processes it starts,
# which inherit the environment) reads the default pair warm after the first. Tests of the
# cache itself pass their own tmp_path root. BACKOFF_TEST_CACHE_DIR picks another folder.
os.environ["BACKOFF_CACHE_DIR"] = os.environ.get("BACKOFF_TEST_CACHE_DIR") or os.path.join(
    tempfile.gettempdir(), f"backoff-serve-test-cache-{os.getuid()}"
)

from tests.support.tiny import tiny_model, tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def pair():
    """(small, large): peaky distributions so the two models disagree often."""
    return tiny_model(1, sharpness=30), tiny_model(2, hidden=64, layers=4, sharpness=30)


# Markers that filter what they say (pyproject.toml lists them): `make test-fast` leaves out
# every test that carries one of these.
SLOW_MARKS = ("slow", "ray", "real_pair", "multinode")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """A test that starts Ray (marked `ray`) runs in the xdist group `ray`: one worker runs
    those modules one after another, never two Ray instances at once; a test marked `ray`,
    `real_pair` or `multinode` is `slow` too."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))
        if any(item.get_closest_marker(m) is not None for m in SLOW_MARKS[1:]):
            item.add_marker(pytest.mark.slow)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is a dev dependency; without it the suite runs serially
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class ModuleOrGroupScheduling(LoadScopeScheduling):
        """xdist's loadgroup with modules kept whole: a test's unit of work is its xdist group
        (the `ray` modules together) or else its module, so module-scoped fixtures (a compiled
        model, a loaded pair) are built once, on one worker. The largest units go first."""

        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return nodeid.rsplit("@", 1)[-1]
            return nodeid.split("::", 1)[0]

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadgroup":
            return ModuleOrGroupScheduling(config, log)
        return None


_exit_status = 0


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_unconfigure(config):
    """Leave without interpreter finalisation, once pytest has printed its summary: the
    native threads that Ray, gRPC and Chromium's driver leave in this process crashed it
    at exit once (a segfault after '582 passed', which turned a green run red)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
