"""Fixtures of tests/deployments: the one way a Ray integration module deploys its Serve app.

A module deploys its own app through `serve_app` (Serve goes down after its last test), or
names a shared one through `shared_app(key, start)`: modules that run one after another and
ask for the same key (test_app_input*.py: the bad-input app; test_app_e2e*.py and
test_app_load.py: the end-to-end app, its live changes last) get the app the first of them
deployed, and it goes down after the last of them. The modules that start Ray run one
after another on one xdist worker (tests/support/tiers.py), so there is never more than one
Ray in a process; consecutive ones that ask for the same local Ray share it
(tests/support/served_app.py's LOCAL), and it goes down after the last Ray module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest

from tests.support import tiers
from tests.support.served_app import LOCAL, ServedApp, running_app

Starter = Callable[..., ServedApp]  # serve_app's callable: (name, models, **running_app's overrides)


class SharedApp:
    """The app deployed under one key, kept up while the next module asks for that key."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.app: ServedApp | None = None
        self.stack = contextlib.ExitStack()

    def get(self, key: str, start: Callable[[Starter], ServedApp], tmp_path_factory) -> ServedApp:
        if key != self.key:
            self.close()
            self.app = start(_starter(self.stack, tmp_path_factory))
            self.key = key
        return self.app

    def close(self) -> None:
        self.key, self.app = None, None
        self.stack.close()
        self.stack = contextlib.ExitStack()


_SHARED = SharedApp()


def _starter(stack: contextlib.ExitStack, tmp_path_factory) -> Starter:
    def start(name: str, *args, **overrides) -> ServedApp:
        return stack.enter_context(running_app(tmp_path_factory.mktemp(name), *args, **overrides))

    return start


@pytest.fixture(scope="module")
def serve_app(tmp_path_factory):
    """`serve_app(name, models=TINY_PAIR, **overrides) -> ServedApp` (the overrides of
    tests.support.served_app.running_app): this module's app, deployed once by its `served`
    fixture; Serve goes down after the module's last test, the local Ray when the next
    module starts none (pytest_runtest_teardown below)."""
    _SHARED.close()  # one Serve app at a time
    with contextlib.ExitStack() as stack:
        yield _starter(stack, tmp_path_factory)


@pytest.fixture(scope="module")
def shared_app(tmp_path_factory):
    """`shared_app(key, start) -> ServedApp`: the app `start(serve_app)` deploys, shared with
    the modules that follow this one and ask for the same key (the module names it in its
    SHARED_APP, which the teardown below reads)."""
    return lambda key, start: _SHARED.get(key, start, tmp_path_factory)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test: the shared app goes down unless the next module shares it,
    and the local Ray unless the next module starts one (served_app.LOCAL; it restarts the
    instance itself if that module asks for other options)."""
    if nextitem is not None and nextitem.module is item.module:
        return
    if _SHARED.key is not None and (nextitem is None or getattr(nextitem.module, "SHARED_APP", None) != _SHARED.key):
        _SHARED.close()
    if nextitem is None or not tiers.starts_ray(nextitem.nodeid.split("::", 1)[0]):
        LOCAL.close()
