"""What GET /v1/routing tells the playground (its levels, the routers a request may name,
the live config's thresholds) and that the page's static files are served. No Ray, no models."""

from __future__ import annotations

import math

from fastapi import FastAPI
from fastapi.testclient import TestClient

from deployments.serving.config import AppArgs, RoutingConfig
from deployments.serving.playground import PAGE_PATH, STATIC, mount_playground, routing_info

CHAIN3 = {"models": {"small": "s", "medium": ["m"], "large": "l"}}


def test_levels_follow_the_chain():
    assert routing_info(AppArgs(), "backoff", RoutingConfig()).levels == ["small", "large"]
    info = routing_info(AppArgs.model_validate(CHAIN3), "chain", RoutingConfig())
    assert info.model == "chain" and len(info.levels) == 3 and info.levels[0] == "small" and info.levels[-1] == "large"
    assert all(len(r.defaults) == 2 for r in info.routers)  # one threshold per boundary


def test_routers_offered_and_their_controls():
    routers = {r.name: r for r in routing_info(AppArgs(), "backoff", RoutingConfig()).routers}
    assert {"entropy", "random", "always-small", "always-large"} <= set(routers)
    assert "classifier" not in routers  # no trained head configured: its scores would mean nothing
    assert not routers["always-small"].thresholds and routers["entropy"].thresholds
    assert routers["entropy"].slider == (0.0, 11.0)
    assert all(
        math.isfinite(low) and math.isfinite(high) and low <= high for low, high in (r.slider for r in routers.values())
    )


def test_classifier_is_offered_with_a_head():
    args = AppArgs.model_validate({"models": {"classifier": "/some/head"}})
    routers = {r.name: r for r in routing_info(args, "backoff", RoutingConfig()).routers}
    assert routers["classifier"].slider == (0.0, 1.0) and routers["classifier"].defaults == [0.5]


def test_thresholds_are_the_config_s_else_the_live_router_s_defaults():
    args = AppArgs()
    info = routing_info(args, "backoff", RoutingConfig(router="entropy", thresholds=[2.5], target_backoff=0.7))
    assert (info.router, info.thresholds, info.target_backoff) == ("entropy", [2.5], 0.7)
    default = routing_info(args, "backoff", RoutingConfig(router="entropy"))
    entropy = next(r for r in default.routers if r.name == "entropy")
    assert default.thresholds == entropy.defaults and len(default.thresholds) == 1
    assert routing_info(args, "backoff", RoutingConfig(router="no-such-router")).thresholds == []


def test_the_page_and_its_files_are_served():
    assert (STATIC / "index.html").is_file()
    app = FastAPI()
    mount_playground(app)
    client = TestClient(app)
    page = client.get(PAGE_PATH)
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert client.get(PAGE_PATH + "/playground.js").status_code == 200
    slash = client.get(PAGE_PATH + "/", follow_redirects=False)
    assert slash.status_code == 307 and slash.headers["location"] == "../playground"
