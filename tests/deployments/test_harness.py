"""deployments/harness.py's free_port: ports the tests' Serve apps bind, picked below the
kernel's ephemeral range (where Ray's outgoing connections take theirs) and never twice."""

from __future__ import annotations

import socket

from deployments import harness


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    top = harness._ephemeral_start()
    ports = [harness.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(harness.PORTS_FROM <= port < top for port in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        picks = iter([busy, busy, 23456])
        monkeypatch.setattr(harness, "_ephemeral_start", lambda: 60000)
        monkeypatch.setattr(harness._RNG, "randrange", lambda lo, hi: next(picks))
        monkeypatch.setattr(harness, "_GIVEN", set())
        assert harness.free_port() == 23456


def test_where_the_ephemeral_range_starts_low_the_kernel_picks_and_never_twice(monkeypatch):
    monkeypatch.setattr(harness, "_ephemeral_start", lambda: harness.PORTS_FROM + 10)
    monkeypatch.setattr(harness, "_GIVEN", set())
    ports = [harness.free_port() for _ in range(20)]
    assert len(set(ports)) == 20 and all(port > 0 for port in ports)


def test_the_loopback_config_drains_every_deployment_quickly_and_still_validates():
    """Every deployment of the loopback app, the Ingress included, polls for running requests
    every DRAIN_POLL_S while it stops (an idle test app goes down in ~1.5 s, not Serve's ~8),
    and Serve's own schema still takes the config."""
    from ray.serve.schema import ServeDeploySchema

    config = harness.loopback_config("small", "large", 8000, 9000)
    deployments = config["applications"][0]["deployments"]
    assert {d["name"] for d in deployments} == {"Ingress", "SmallModel", "LargeModel"}
    assert all(d["graceful_shutdown_wait_loop_s"] == harness.DRAIN_POLL_S for d in deployments)
    ServeDeploySchema.model_validate(config)
