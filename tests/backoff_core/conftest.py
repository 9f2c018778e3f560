"""Fixtures of tests/backoff_core only: a chain of three tiny models and a soft pair for the
statistical tests (tests/conftest.py has the tokenizer and the pair every level uses)."""

from __future__ import annotations

import pytest

from tests.support.tiny import tiny_model


@pytest.fixture(scope="session")
def chain3():
    return (
        tiny_model(1, sharpness=30),
        tiny_model(3, hidden=48, layers=3, sharpness=30),
        tiny_model(2, hidden=64, layers=4, sharpness=30),
    )


@pytest.fixture(scope="session")
def soft_pair():
    """Moderately peaked models for the statistical tests (every token has mass)."""
    return tiny_model(11, sharpness=4), tiny_model(12, hidden=64, layers=4, sharpness=4)
