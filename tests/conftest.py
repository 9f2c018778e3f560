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
# one thread, so that the workers share the cores instead of fighting over them.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // WORKERS))
# inductor compiles a graph's kernels in a pool of processes (each importing torch) unless
# told otherwise; with no core to spare that only adds work: tests/backoff_core/runners/
# test_static_ragged.py alone, cold, on 2 cores: 94 s and 134 CPU-s compiling in process,
# 106 s and 148 CPU-s with the pool
if (os.cpu_count() or 1) <= 2 * WORKERS:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# The converted-model cache (backoff_core/models/gguf_cache.py) of test runs: never the
# user's, and one per machine so that every run (and the CLI / Ray processes it starts,
# which inherit the environment) reads the default pair warm after the first. Tests of the
# cache itself pass their own tmp_path root. BACKOFF_TEST_CACHE_DIR picks another folder.
os.environ["BACKOFF_CACHE_DIR"] = os.environ.get("BACKOFF_TEST_CACHE_DIR") or os.path.join(
    tempfile.gettempdir(), f"backoff-serve-test-cache-{os.getuid()}"
)

from tests.support import tiers  # noqa: E402
from tests.support.tiers import IMPLY_SLOW  # noqa: E402
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
def pytest_collection_modifyitems(config, items):
    """A test marked `ray`, `real_pair` or `multinode` is `slow` too; the Ray modules run in
    tests/support/tiers.py's order: the first Ray unit first, the late one last."""
    for item in items:
        if any(item.get_closest_marker(m) is not None for m in IMPLY_SLOW):
            item.add_marker(pytest.mark.slow)
    items[:] = tiers.ray_order(items)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: the GPU image has no pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadscope` (make test): modules whole, the Ray modules one unit (tiers.py)."""
    return tiers.scheduler(config, log) if config.getvalue("dist") == "loadscope" else None


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
