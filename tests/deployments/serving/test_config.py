"""Configuration and wiring of the Serve app without a cluster: the config YAML, the
`backoff serve` overrides, routing resolution, placement options, session affinity."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from backoff_core.types import CatchUp, FinishReason, GenerationResult, KVSpec, Timings
from clients.wire.types import ChatMessage, GenerateParams
from deployments import serve_cli
from deployments.affinity import rendezvous
from deployments.app import build_app, replica_options
from deployments.serve_cli import DEFAULT_CONFIG, _parser, apply_overrides
from deployments.serving.config import AppArgs, ReplicaConfig, RoutingConfig
from deployments.serving.formats import response_body, usage_of
from deployments.serving.models_config import ModelsConfig
from deployments.serving.requests import RoutingOverrides, choice_seed, routing_params, serve_request


def test_packaged_config_is_a_valid_serve_config():
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    assert app.import_path == "deployments.app:build_app"
    AppArgs.model_validate(app.args)
    users = {d.name: d.user_config for d in app.deployments}
    RoutingConfig.model_validate(users["SmallModel"])
    assert (
        "deployments.serving.grpc_service.add_BackoffServicer_to_server" in schema.grpc_options.grpc_servicer_functions
    )
    assert schema.http_options.host == "127.0.0.1"  # loopback unless exposed on purpose


def test_log_level_sets_the_apps_logging_and_serve_s_access_lines_only_at_debug():
    """One line per request by default (the Ingress's, at INFO); `--log-level DEBUG` adds Serve's
    access line of every call between replicas (each catch-up)."""
    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    assert base["applications"][0]["logging_config"] == {"log_level": "INFO", "enable_access_log": False}
    assert base["logging_config"] == {"enable_access_log": False}  # the proxies' line per request
    for given, want in (("debug", ("DEBUG", True)), ("WARNING", ("WARNING", False)), ("info", ("INFO", False))):
        schema = ServeDeploySchema.model_validate(apply_overrides(base, _parser().parse_args(["--log-level", given])))
        for logging in (schema.applications[0].logging_config, schema.logging_config):
            assert (logging.log_level, logging.enable_access_log) == want
    with pytest.raises(SystemExit):
        _parser().parse_args(["--log-level", "loud"])


def test_every_config_field_is_described():
    from deployments.serving import config, edge_config

    for model in (
        ModelsConfig,
        config.RoutingConfig,
        config.CatchUpConfig,
        config.ReplicaConfig,
        edge_config.AccessConfig,
        edge_config.LimitsConfig,
        edge_config.AdmissionConfig,
        config.AppArgs,
    ):
        missing = [name for name, f in model.model_fields.items() if not f.description]
        assert not missing, f"{model.__name__}: {missing}"


def test_cli_overrides_land_in_args_and_user_config():
    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    args = _parser().parse_args(
        [
            "--small",
            "s",
            "--large",
            "l",
            "--medium",
            "m",
            "--router",
            "max-prob",
            "--http-port",
            "8123",
            "--no-batching",
            "--launch-ahead",
        ]
    )
    out = apply_overrides(base, args)
    app = out["applications"][0]
    assert app["args"]["launch_ahead"] is True and base["applications"][0]["args"]["launch_ahead"] == "auto"
    assert AppArgs.model_validate(app["args"]).launch_ahead is True
    for given, want in (("false", False), ("auto", "auto"), ("true", True)):
        chosen = apply_overrides(base, _parser().parse_args(["--launch-ahead", given]))["applications"][0]["args"]
        assert AppArgs.model_validate(chosen).launch_ahead == want
    assert app["args"]["models"]["medium"] == ["m"] and out["http_options"]["port"] == 8123
    users = {d["name"]: d["user_config"] for d in app["deployments"]}
    assert users["SmallModel"]["router"] == "max-prob" and users["SmallModel"]["thresholds"] is None
    assert users["LargeModel"]["batching"] is False
    assert base["applications"][0]["args"]["models"]["small"] is None  # a copy was changed
    out = apply_overrides(base, _parser().parse_args(["--threshold", "1.5,2.5"]))
    assert {d["name"]: d for d in out["applications"][0]["deployments"]}["SmallModel"]["user_config"]["thresholds"] == [
        1.5,
        2.5,
    ]


def test_static_kv_settings_reach_the_models_config():
    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    args = _parser().parse_args(
        ["--device", "cuda", "--dtype", "bfloat16", "--kv-budget", "65536", "--kv-max-len", "1024"]
    )
    models = ModelsConfig.model_validate(apply_overrides(base, args)["applications"][0]["args"]["models"])
    assert models.kv_budget_tokens == 65536 and models.kv_max_len == 1024
    assert models.cuda_graphs and models.dtype == "bfloat16"
    assert ModelsConfig().kv_budget_tokens == "auto" and ModelsConfig().static_kv == "auto"  # resolved per replica
    with pytest.raises(ValidationError, match="holds no slot"):
        ModelsConfig(kv_budget_tokens=1000, kv_max_len=1024, static_kv=True)


@pytest.mark.parametrize(
    "argv, mode",
    [
        ([], "auto"),
        (["--ragged-catch-ups"], "on"),
        (["--ragged-catch-ups", "off"], "off"),
        (["--ragged-catch-ups", "auto"], "auto"),
    ],
)
def test_ragged_catch_ups_reach_the_kv_spec_auto_by_default(pair, argv, mode):
    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    args = _parser().parse_args(argv + ["--kv-budget", "4096", "--kv-max-len", "256"])
    models = ModelsConfig.model_validate(apply_overrides(base, args)["applications"][0]["args"]["models"])
    assert models.ragged_catch_ups == mode and models.kv_spec(pair[1]).ragged == mode


@pytest.mark.parametrize(
    "argv, mode", [([], "auto"), (["--compile-layers", "off"], "off"), (["--compile-layers", "on"], "on")]
)
def test_compiled_layers_reach_the_kv_spec_auto_by_default(pair, argv, mode):
    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    args = _parser().parse_args(argv + ["--kv-budget", "4096", "--kv-max-len", "256"])
    models = ModelsConfig.model_validate(apply_overrides(base, args)["applications"][0]["args"]["models"])
    assert models.compile_layers == mode and models.kv_spec(pair[1]).compile == mode


def test_compiled_layers_refuse_what_is_not_a_mode():
    with pytest.raises(ValidationError, match="compile_layers"):
        ModelsConfig(compile_layers="sometimes")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--compile-layers", "sometimes"])


def test_ragged_catch_ups_read_the_old_booleans_and_refuse_the_rest():
    """true / false, the spelling before "auto", read as on / off; anything else is refused, naming the field."""
    assert ModelsConfig(ragged_catch_ups=True).ragged_catch_ups == "on"
    assert ModelsConfig(ragged_catch_ups=False).ragged_catch_ups == "off"
    with pytest.raises(ValidationError, match="ragged_catch_ups"):
        ModelsConfig(ragged_catch_ups="sometimes")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--ragged-catch-ups", "sometimes"])
    with pytest.raises(ValueError, match="ragged must be one of auto, on, off"):
        KVSpec(1024, 256, ragged=True)


@pytest.mark.parametrize(
    ("field", "engine_default"),
    [("prefill_chunk_tokens", "PREFILL_CHUNK_TOKENS"), ("catch_up_wait_ms", "CATCH_UP_WAIT_MS")],
)
def test_engine_settings_default_to_the_engines_and_refuse_a_negative(field, engine_default):
    import backoff_core.engine.engine as engine

    base = yaml.safe_load(DEFAULT_CONFIG.read_text())["applications"][0]["args"]
    default = getattr(engine, engine_default)
    assert getattr(AppArgs(), field) == getattr(AppArgs.model_validate(base), field) == default
    assert getattr(AppArgs(**{field: 0}), field) == 0  # off
    with pytest.raises(ValidationError, match=field):
        AppArgs(**{field: -1})


def test_launch_ahead_is_auto_by_default_and_only_true_is_refused_beside_catch_ups_in_flight():
    """auto (the default) makes way for overlap_catch_ups (ahead.resolve); true is refused beside it."""
    assert AppArgs().launch_ahead == "auto" and AppArgs(launch_ahead=True).launch_ahead is True
    assert AppArgs(launch_ahead="auto", overlap_catch_ups=True).overlap_catch_ups
    assert AppArgs(launch_ahead=False, overlap_catch_ups=True).launch_ahead is False
    with pytest.raises(ValidationError, match="do not go together"):
        AppArgs(launch_ahead=True, overlap_catch_ups=True)
    with pytest.raises(ValidationError):
        AppArgs(launch_ahead="sometimes")


def test_models_config_refuses_half_a_pair():
    with pytest.raises(ValidationError):
        ModelsConfig(small="a")
    with pytest.raises(ValidationError):
        ModelsConfig(medium=["m"])
    assert ModelsConfig(small="a", large="b", medium=["m"]).num_levels == 3


@pytest.mark.parametrize(
    "overrides, policy, expected",
    [
        (RoutingOverrides(), RoutingConfig(router="entropy", thresholds=[2.0]), ("entropy", (2.0,), None)),
        (
            RoutingOverrides(thresholds=(3.0,)),
            RoutingConfig(router="entropy", thresholds=[2.0]),
            ("entropy", (3.0,), None),
        ),
        # another router: the config's threshold belongs to the config's router
        (
            RoutingOverrides(router="max-prob"),
            RoutingConfig(router="entropy", thresholds=[2.0]),
            ("max-prob", None, None),
        ),
        (RoutingOverrides(), RoutingConfig(router="entropy", target_backoff=0.7), ("entropy", None, 0.7)),
        # a request's own threshold switches the config's target rate off
        (RoutingOverrides(thresholds=(1.0,)), RoutingConfig(target_backoff=0.7), ("entropy", (1.0,), None)),
        (RoutingOverrides(target_backoff=0.2), RoutingConfig(), ("entropy", None, 0.2)),
    ],
)
def test_request_fields_override_the_live_config(overrides, policy, expected):
    r = routing_params(overrides, policy)
    assert (r.router, r.thresholds, r.target_backoff) == expected


def test_edge_params_become_core_records():
    req = serve_request(
        "id",
        GenerateParams(max_tokens=5, temperature=0, stop=["x"], thresholds=[1, 2]),
        messages=[ChatMessage(role="user", content="hi")],
    )
    assert req.messages == (("user", "hi"),) and req.sampling.max_tokens == 5 and req.sampling.greedy
    assert req.overrides.thresholds == (1.0, 2.0) and req.sampling.stop == ("x",)
    assert serve_request("id", GenerateParams(), prompt="p", default_max_tokens=7).sampling.max_tokens == 7
    with pytest.raises(ValueError):
        serve_request("id", GenerateParams(top_k=0, temperature=float("inf")), prompt="p")


def test_choice_seeds_keep_choice_0_and_draw_the_others_apart_within_int64():
    assert choice_seed(None, 3) is None  # unseeded: each request draws a fresh seed
    assert [choice_seed(s, 0) for s in (0, -5, 2**63 - 1)] == [0, -5, 2**63 - 1]  # n = 1 unchanged
    for seed in (0, 1, -1, 7, 2**63 - 1, -(2**63)):
        seeds = [choice_seed(seed, j) for j in range(64)]
        assert len(set(seeds)) == 64 and all(-(2**63) <= x < 2**63 for x in seeds)
        assert seeds == [choice_seed(seed, j) for j in range(64)]  # a pure function
        GenerateParams(seed=seeds[-1])  # a seed the edge itself takes
    # neighbouring seeds do not share choices (seed + j would: seed 1's choice 0 = seed 0's choice 1)
    assert not {choice_seed(0, j) for j in range(1, 64)} & {choice_seed(1, j) for j in range(64)}
    req = serve_request("id", GenerateParams(seed=9), prompt="p", choice=2)
    assert req.sampling.seed == choice_seed(9, 2) != 9


def test_placement_follows_the_cluster():
    rc = ReplicaConfig(custom_resource="large_gpu", num_replicas=2)
    cpu = replica_options(rc, {"CPU": 2})
    assert cpu["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0} and cpu["num_replicas"] == 2
    gpu = replica_options(rc, {"CPU": 8, "GPU": 2, "large_gpu": 1})
    assert gpu["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"large_gpu": 1}}
    one_gpu = replica_options(rc, {"CPU": 16, "GPU": 1})  # no node types: small and large share it
    assert one_gpu["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert replica_options(rc, {"GPU": 1}, models=3)["ray_actor_options"]["num_gpus"] == pytest.approx(1 / 3)
    assert replica_options(rc, {"GPU": 8})["ray_actor_options"]["num_gpus"] == 1.0
    scaled = replica_options(ReplicaConfig(gpus=0.25, min_replicas=1, max_replicas=3), {"GPU": 1})
    assert scaled["ray_actor_options"]["num_gpus"] == 0.25
    assert scaled["autoscaling_config"]["max_replicas"] == 3 and "num_replicas" not in scaled


def test_a_chain_of_three_adds_one_large_like_deployment():
    app = build_app({"models": {"small": "s", "medium": ["m"], "large": "l"}})
    from ray.serve._private.build_app import build_app as materialize

    names = sorted(d.name for d in materialize(app, name="x").deployments)
    assert names == ["Ingress", "LargeModel", "MediumModel1", "SmallModel"]
    deployments = {d.name: d for d in materialize(app, name="x").deployments}
    # its step thread's blocking catch-up calls need the handle router on a loop of its own;
    # every replica takes messages up to max_message_bytes on Serve's gRPC channels
    cap = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(256 << 20)}
    small = deployments.pop("SmallModel")
    assert small.ray_actor_options["runtime_env"]["env_vars"] == {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1", **cap}
    assert all(d.ray_actor_options["runtime_env"]["env_vars"] == cap for d in deployments.values())


@dataclass(frozen=True)
class _Id:
    unique_id: str


@dataclass(frozen=True)
class _Replica:
    replica_id: _Id


def test_rendezvous_moves_only_the_lost_replicas_sessions():
    replicas = [_Replica(_Id(f"r{i}")) for i in range(3)]
    keys = [f"req-{i}#{i}" for i in range(300)]
    before = {k: rendezvous(k, replicas).replica_id.unique_id for k in keys}
    assert set(before.values()) == {"r0", "r1", "r2"}
    survivors = [r for r in replicas if r.replica_id.unique_id != "r1"]
    random.shuffle(survivors)
    after = {k: rendezvous(k, survivors).replica_id.unique_id for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "r1")


def test_usage_counts_tokens_by_source():
    result = GenerationResult(
        request_id="r",
        text="a b c",
        token_ids=(5, 6, 7),
        sources=(0, 1, 0),
        num_levels=2,
        finish_reason=FinishReason.LENGTH,
        prompt_tokens=4,
        catch_ups=(CatchUp(1, 3, 0.1),),
        rollbacks=0,
        timings=Timings(0, (), (), 0, 0),
    )
    usage = usage_of(result)
    assert (usage.small_tokens, usage.large_tokens, usage.large_calls, usage.total_tokens) == (2, 1, 1, 7)
    body = response_body("cmpl-1", "backoff", 0, result, chat=True)
    assert body["choices"][0]["message"]["content"] == "a b c" and body["choices"][0]["backoff"]["sources"] == [0, 1, 0]
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_usage_reports_the_cached_prompt_tokens_on_http_and_grpc():
    """OpenAI's usage.prompt_tokens_details.cached_tokens (what guidellm and others read); on
    gRPC Usage.cached_prompt_tokens; a batch sums them."""
    from clients.wire.proto import usage_from_pb, usage_to_pb
    from deployments.serving.formats import summed_usage

    def result(cached: int) -> GenerationResult:
        return GenerationResult(
            request_id="r",
            text="a",
            token_ids=(5,),
            sources=(0,),
            num_levels=2,
            finish_reason=FinishReason.LENGTH,
            prompt_tokens=40,
            catch_ups=(),
            rollbacks=0,
            timings=Timings(0, (), (), 0, 0),
            cached_prompt_tokens=cached,
        )

    usage = usage_of(result(32))
    body = response_body("cmpl-1", "backoff", 0, result(32), chat=False)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert usage_to_pb(usage).cached_prompt_tokens == 32 and usage_from_pb(usage_to_pb(usage)) == usage
    assert summed_usage([result(32), result(0), result(64)]).prompt_tokens_details.cached_tokens == 96


def test_cluster_yaml_is_a_valid_launcher_config_with_small_and_large_gpu_nodes():
    import json
    from pathlib import Path

    import jsonschema
    import ray.autoscaler

    config = yaml.safe_load((Path(__file__).resolve().parents[3] / "cluster.yaml").read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert types["small_gpu"]["resources"]["small_gpu"] == 1 and types["large_gpu"]["resources"]["large_gpu"] == 1
    served = yaml.safe_load(DEFAULT_CONFIG.read_text())["applications"][0]["args"]
    assert (served["small"]["custom_resource"], served["large"]["custom_resource"]) == ("small_gpu", "large_gpu")


def test_routing_config_takes_thresholds_or_its_old_spelling_threshold():
    """`thresholds` is the name; a user_config written with `threshold` still applies, and
    `backoff serve --threshold` replaces either spelling. Both at once is refused, not guessed."""
    assert RoutingConfig.model_validate({"threshold": [1.0, 2.0]}).thresholds == [1.0, 2.0]
    assert RoutingConfig.model_validate({"thresholds": [1.0, 2.0]}).thresholds == [1.0, 2.0]
    assert RoutingConfig.model_validate({"threshold": None, "thresholds": [3.0]}).thresholds == [3.0]
    with pytest.raises(ValidationError, match="not both"):
        RoutingConfig.model_validate({"threshold": [1.0], "thresholds": [1.0]})
    with pytest.raises(ValidationError, match="1e38"):
        RoutingConfig.model_validate({"threshold": [1e39]})  # the old spelling keeps the range
    assert "threshold" not in RoutingConfig().model_dump()  # dumped (and redeployed) as thresholds
    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    _routing(base)["threshold"] = _routing(base).pop("thresholds")  # a config written before the rename
    out = _routing(apply_overrides(base, _parser().parse_args(["--threshold", "2.5"])))
    assert "threshold" not in out and RoutingConfig.model_validate(out).thresholds == [2.5]


def test_routing_config_thresholds_take_a_requests_forms_and_are_checked_at_load():
    """The config's thresholds are a request's (one wire type, one core check): a number or a
    list, ascending, refused when the config is read rather than at every request."""
    assert RoutingConfig.model_validate({"thresholds": 1.5}).thresholds == [1.5]
    assert RoutingConfig.model_validate({"threshold": 2}).thresholds == [2.0]
    for bad, says in (([2.0, 1.0], "ascending"), ([], "at least 1"), ("1.5", "number"), ([1e39], "1e38")):
        with pytest.raises(ValidationError, match=says):
            RoutingConfig.model_validate({"thresholds": bad})


def test_a_requests_thresholds_are_checked_where_it_enters():
    """serve_request (the Ingress, before any SmallModel): the wire's list becomes the core's
    tuple through parse_thresholds, so a descending list is a 400 / INVALID_ARGUMENT there."""
    assert serve_request("id", GenerateParams(thresholds=2), prompt="p").overrides.thresholds == (2.0,)
    with pytest.raises(ValueError, match=r"ascending, got \[2.0, 1.0\]"):
        serve_request("id", GenerateParams(thresholds=[2, 1]), prompt="p")


def _routing(config: dict) -> dict:
    """The SmallModel's user_config (the one deployment with a router)."""
    return next(d["user_config"] for d in config["applications"][0]["deployments"] if "router" in d["user_config"])


def test_a_config_naming_the_old_small_deployment_still_applies(capsys):
    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for d in base["applications"][0]["deployments"]:
        if d["name"] == "SmallModel":
            d["name"] = "SmallRouter"  # a config written before the rename
    out = apply_overrides(base, _parser().parse_args(["--router", "entropy"]))
    names = [d["name"] for d in out["applications"][0]["deployments"]]
    assert "SmallRouter" not in names and names.count("SmallModel") == 1
    small = {d["name"]: d for d in out["applications"][0]["deployments"]}["SmallModel"]
    assert small["user_config"]["router"] == "entropy" and "inject_fault_seed" in small["user_config"]  # the old entry
    assert "'SmallRouter' is now called 'SmallModel'" in capsys.readouterr().err


def test_direct_ingress_ports_follow_the_proxys():
    env = serve_cli.direct_ingress_env(8000, 9000)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"]) == (
        "8001",
        "9001",
    )
    span = int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) - int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
    assert span == serve_cli.DIRECT_PORTS


def test_direct_ingress_on_a_cluster_is_refused_with_the_way_to_set_it(capsys, monkeypatch):
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    assert serve_cli.main(["--direct-ingress", "--address", "ray://head:10001"]) == 2
    assert "direct_ingress_env" in capsys.readouterr().err
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in os.environ  # nothing was started or set


def test_direct_ingress_puts_its_ports_in_the_environment_ray_starts_with(capsys, monkeypatch):
    started = {}
    for key in serve_cli.direct_ingress_env(0, 0):
        monkeypatch.setenv(key, "unset")  # whatever main() sets is undone after the test
    monkeypatch.setattr(serve_cli, "start_ray", lambda *args: started.update(os.environ))
    monkeypatch.setattr(serve_cli, "run_config", lambda config, blocking: None)
    assert serve_cli.main(["--direct-ingress", "--http-port", "8100", "--grpc-port", "9100", "--non-blocking"]) == 0
    assert started["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert (started["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], started["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"]) == (
        "8101",
        "9101",
    )
    assert "HTTP on port 8101 and gRPC on port 9101" in capsys.readouterr().err


@pytest.mark.parametrize("fails", [False, True])
def test_serve_run_reads_its_config_file_and_the_file_is_gone_after(monkeypatch, fails):
    """run_config hands `serve run` the config in a temporary file, which is deleted once
    `serve run` returns or raises (before, each `backoff serve` left one in /tmp)."""
    from ray.serve.scripts import cli

    seen = {}

    def serve_run(args, prog_name, standalone_mode):
        seen["path"], seen["config"] = args[1], yaml.safe_load(Path(args[1]).read_text())
        seen["args"] = args
        if fails:
            raise RuntimeError("the deploy failed")

    monkeypatch.setattr(serve_cli, "local_serve_env", lambda: None)
    monkeypatch.setattr(cli, "main", serve_run)
    config = {"applications": [{"name": "backoff", "args": {"models": {"small": "s"}}}]}
    if fails:
        with pytest.raises(RuntimeError, match="deploy failed"):
            serve_cli.run_config(config, blocking=False)
    else:
        serve_cli.run_config(config, blocking=False)
    assert seen["config"] == config and seen["args"] == ["run", seen["path"], "--non-blocking"]
    assert not Path(seen["path"]).exists()
