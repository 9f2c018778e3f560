"""Fixtures of tests/deployments: the one way a Ray integration module deploys its Serve app."""

from __future__ import annotations

import contextlib

import pytest

from tests.support.served_app import ServedApp, running_app


@pytest.fixture(scope="module")
def serve_app(tmp_path_factory):
    """`serve_app(name, models=TINY_PAIR, **overrides) -> ServedApp` (the overrides of
    tests.support.served_app.running_app): this module's app, deployed once by its `served`
    fixture; Serve and Ray go down after the module's last test."""
    with contextlib.ExitStack() as stack:

        def start(name: str, *args, **overrides) -> ServedApp:
            return stack.enter_context(running_app(tmp_path_factory.mktemp(name), *args, **overrides))

        yield start
