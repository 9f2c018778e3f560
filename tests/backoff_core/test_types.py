"""The records of types.py that carry a hand-written __init__ behave as their dataclass would."""

import dataclasses
import inspect

import pytest

from backoff_core.types import Logprob, TokenEvent, TokenLogprobs


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
