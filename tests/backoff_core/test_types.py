"""The records of types.py that carry a hand-written __init__ behave as their dataclass would;
parse_thresholds takes every form a request's thresholds come in and refuses each bad one."""

import dataclasses
import inspect
import math

import pytest

from backoff_core.types import Logprob, RoutingParams, TokenEvent, TokenLogprobs, parse_thresholds


def test_token_event_init_matches_its_fields():
    # its __init__ is written out for speed (types.py): the same names, order and defaults
    params = list(inspect.signature(TokenEvent.__init__).parameters.values())[1:]
    fields = dataclasses.fields(TokenEvent)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        assert p.default == (inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default), f.name


def test_token_event_is_a_frozen_dataclass():
    top = TokenLogprobs(Logprob(7, "x", b"x", -0.5), (), 3)
    event = TokenEvent(7, 1, "x", 4, retracted=2, retracted_text="ab", logprobs=top)
    assert (event.token_id, event.source, event.text, event.index) == (7, 1, "x", 4)
    assert (event.retracted, event.retracted_text, event.logprobs) == (2, "ab", top)
    assert TokenEvent(7, 1, "x", 4).retracted == 0 and TokenEvent(7, 1, "x", 4).logprobs is None
    assert event == TokenEvent(7, 1, "x", 4, 2, "ab", top) and event != TokenEvent(7, 1, "x", 4)
    assert hash(event) == hash(TokenEvent(7, 1, "x", 4, 2, "ab", top))
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.text = "y"
    assert dataclasses.replace(event, logprobs=None) == TokenEvent(7, 1, "x", 4, 2, "ab")
    assert dataclasses.asdict(TokenEvent(1, 0, "a", 0))["retracted_text"] == ""
    assert repr(TokenEvent(1, 0, "a", 0)).startswith("TokenEvent(token_id=1, source=0")


@pytest.mark.parametrize(
    "value, expected",
    [
        (2.5, (2.5,)),  # one number: a two-model chain
        (2, (2.0,)),
        ([1, 2.5], (1.0, 2.5)),  # a list: one per boundary
        ((1.0, 1.0), (1.0, 1.0)),  # equal is ascending (the middle level never taken)
        ("2,4", (2.0, 4.0)),  # the command line's
        (" -1.5 , 3e2 ", (-1.5, 300.0)),
        ("inf", (math.inf,)),  # kept: admission clamps it to float64's finite end
        ([-math.inf, 0.0], (-math.inf, 0.0)),
    ],
)
def test_parse_thresholds_takes_every_form(value, expected):
    assert parse_thresholds(value) == expected
    assert all(type(t) is float for t in parse_thresholds(value))
    assert RoutingParams(thresholds=value).thresholds == expected  # the record stores the canonical tuple


@pytest.mark.parametrize(
    "value, message",
    [
        ([2.0, 1.0], r"ascending, got \[2.0, 1.0\]"),
        ("4,2", "ascending"),
        ([0.5, math.nan], "NaN"),
        ("nan", "NaN"),
        ([], "at least one threshold"),
        ((), "at least one threshold"),
        ("", "numbers separated by commas"),
        ("2,,4", "numbers separated by commas"),
        ("high", "numbers separated by commas, got 'high'"),
        (True, "a number or a list of numbers"),
        ([1.0, True], "a number or a list of numbers"),
        ([1.0, "2"], "a number or a list of numbers"),
        ({"a": 1}, "a number or a list of numbers"),
        (None, "a number or a list of numbers"),
    ],
)
def test_parse_thresholds_refuses_each_bad_value_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        parse_thresholds(value)
    if value is not None:  # RoutingParams' None is the router's default
        with pytest.raises(ValueError, match=message):
            RoutingParams(thresholds=value)
