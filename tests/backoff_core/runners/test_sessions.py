"""runners/sessions.py: the session table both runners and RemoteLarge share, over a fake
subclass that records what it was asked to make, crop and free."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from backoff_core.runners.sessions import Session, SessionError, SessionTable


@dataclass(kw_only=True)
class _Tagged(Session):
    tag: str


class _Table(SessionTable[_Tagged]):
    name = "fake"

    def __init__(self) -> None:
        super().__init__()
        self.released: list[str] = []
        self.cropped: list[tuple[str, int]] = []

    def _new_session(self, request_id: str, refill: bool) -> _Tagged:
        return _Tagged(tag=request_id, refill=refill)

    def _release(self, session: _Tagged) -> None:
        self.released.append(session.tag)

    def _crop(self, session: _Tagged, length: int) -> None:
        self.cropped.append((session.tag, length))


def test_open_close_and_lookups():
    table = _Table()
    table.open("a")
    table.open("b", refill=True)
    assert table.request_ids() == ["a", "b"] and table.has("a") and table._get("b").refill
    with pytest.raises(ValueError, match="already open"):
        table.open("a")
    table.close("a")
    table.close("a")  # closing twice frees once
    assert table.released == ["a"] and not table.has("a")
    with pytest.raises(SessionError, match="fake: no session 'a'"):
        table.length("a")


def test_crop_moves_the_length_within_bounds():
    table = _Table()
    table.open("a")
    table._get("a").length = 5
    table.crop("a", 3)
    assert table.length("a") == 3 and table.cropped == [("a", 3)]
    for bad in (4, -1):
        with pytest.raises(ValueError, match="cannot crop 3 positions"):
            table.crop("a", bad)
    assert table.length("a") == 3 and table.cropped == [("a", 3)]


def test_idle_sessions_are_those_not_used_since():
    table = _Table()
    table.open("old")
    table.open("new")
    table._get("old").last_used = time.monotonic() - 60.0
    assert table.idle_sessions(30.0) == ["old"]


def test_an_extend_names_each_session_once_with_new_ids():
    table = _Table()
    table.open("a")
    table.open("b")
    assert [s.tag for s in table._extending([("b", [3]), ("a", [4, 5])])] == ["b", "a"]
    with pytest.raises(ValueError, match="appears twice"):
        table._extending([("a", [3]), ("a", [4])])
    with pytest.raises(ValueError, match="at least one token"):
        table._extending([("a", [])])
    with pytest.raises(SessionError):
        table._extending([("c", [3])])
