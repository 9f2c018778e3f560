"""Prefix routing without a cluster: the prompt keys the router matches, and the config switch
as the builder applies it (the served behaviour: test_app_prefix.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from backoff_core.types import SamplingParams  # noqa: E402
from deployments.app import build_app  # noqa: E402
from deployments.prefix_routing import PrefixAffinity, prompt_key  # noqa: E402
from deployments.serving.requests import RoutingOverrides, ServeRequest  # noqa: E402

SYSTEM = ("system", "You answer questions about the Python standard library.")


def _request(**prompt) -> ServeRequest:
    return ServeRequest("r", SamplingParams(max_tokens=1), RoutingOverrides(), **prompt)


def test_a_chat_key_grows_with_its_messages_in_order():
    first = prompt_key(_request(messages=(SYSTEM, ("user", "What is os.path?"))), 2048)
    later = prompt_key(_request(messages=(SYSTEM, ("user", "What is os.path?"), ("assistant", "A module."))), 2048)
    other = prompt_key(_request(messages=(SYSTEM, ("user", "What is json?"))), 2048)
    system = prompt_key(_request(messages=(SYSTEM,)), 2048)
    assert later.startswith(first) and first.startswith(system) and other.startswith(system)
    assert not other.startswith(first)
    # the roles are part of the key: the same words from another role are another prompt
    assert prompt_key(_request(messages=(("user", SYSTEM[1]),)), 2048) != system


def test_token_ids_are_one_character_each_and_keys_are_bounded():
    key = prompt_key(_request(prompt_ids=(0, 1, 49151, 7)), 2048)
    assert len(key) == 5 and key[1:] == "".join(chr(0xE000 + t) for t in (0, 1, 49151, 7))
    assert prompt_key(_request(prompt_ids=tuple(range(100))), 16) == prompt_key(
        _request(prompt_ids=tuple(range(50))), 16
    )
    assert prompt_key(_request(prompt="x" * 5000), 2048) == "x" * 2048
    # the three forms never share a key: text is not tokenized at the caller
    assert prompt_key(_request(prompt="w1 w2"), 64) != prompt_key(_request(prompt_ids=(3, 4)), 64)


def test_calls_without_a_serve_request_have_no_key():
    router = PrefixAffinity.__new__(PrefixAffinity)  # state only: no cluster
    router.key_chars = 64
    assert router._extract_text_from_request(SimpleNamespace(args=[])) is None  # info()
    assert router._extract_text_from_request(SimpleNamespace(args=["owner"])) is None
    assert router._extract_text_from_request(SimpleNamespace(args=[_request(prompt="abc"), True])) == "abc"


def _router_config(app, deployment: str):
    """The request_router_config of `deployment` in the built app (Ingress -> SmallModel -> LargeModel)."""
    small = app._bound_deployment.init_args[0]._bound_deployment
    found = {"SmallModel": small, "LargeModel": small.init_args[1]._bound_deployment}[deployment]
    return found._deployment_config.request_router_config


def test_the_switch_picks_the_small_models_router_and_leaves_session_affinity_alone():
    on = build_app({"prefix_routing": {"max_imbalance": 3}})
    off = build_app({"prefix_routing": {"enabled": False}})
    assert _router_config(on, "SmallModel").request_router_class == "deployments.prefix_routing:PrefixAffinity"
    assert _router_config(on, "SmallModel").request_router_kwargs["imbalanced_threshold"] == 3
    assert _router_config(off, "SmallModel").request_router_class.endswith("PowerOfTwoChoicesRequestRouter")
    for app in (on, off):
        assert _router_config(app, "LargeModel").request_router_class == "deployments.affinity:SessionAffinity"
