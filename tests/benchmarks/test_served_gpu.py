"""benchmarks/served_gpu.py without Ray: its plan, the app's config it deploys, its ratios and token check.
The script itself ran end to end on the CPU by hand (docs/gpu.md, "The served path": its dry run)."""

from __future__ import annotations

import pytest

from benchmarks import served_gpu
from deployments.serving.config import AppArgs


def test_the_plan_is_the_gpu_stage_on_cuda_and_a_short_dry_run_on_the_cpu(tmp_path):
    gpu = served_gpu.plan(served_gpu.parse(["--small", "S", "--large", "L"]))
    assert (gpu.device, gpu.dtype, gpu.kv_budget, gpu.max_len, gpu.streams, gpu.tokens) == (
        "cuda", "bfloat16", 65536, 1024, (1, 16, 64), 64)  # fmt: skip
    assert gpu.routings == ("random b=0.9", "always-large") and gpu.transports == ("http", "grpc")
    dry = served_gpu.plan(served_gpu.parse(["--device", "cpu", "--models-dir", str(tmp_path)]))
    assert (dry.device, dry.dtype, dry.streams, dry.tokens) == ("cpu", "float32", (1, 4), 8)
    assert dry.small.endswith("tiny/small") and dry.large.endswith("tiny/large")  # built, the default pair's shape
    with pytest.raises(SystemExit):
        served_gpu.parse(["--routings", "oracle"])


def test_the_app_shares_one_gpu_between_the_models_and_keeps_the_ingress_off_it():
    p = served_gpu.plan(served_gpu.parse(["--small", "S", "--large", "L", "--streams", "1", "64"]))
    config = served_gpu.served_config(p, 20001, 20002)
    app = config["applications"][0]
    args = AppArgs.model_validate(app["args"])  # what build_app validates
    assert app["route_prefix"] == "/backoff" and config["grpc_options"]["port"] == 20002
    assert (args.small.gpus, args.large.gpus, args.ingress.gpus) == ("auto", "auto", "none")
    m = args.models
    assert (m.small, m.large, m.device, m.dtype, m.kv_budget_tokens, m.kv_max_len, m.prefix_cache_tokens) == (
        "S", "L", "cuda", "bfloat16", 65536, 1024, 0)  # fmt: skip
    assert args.admission.max_live_requests == 64 and args.small.max_ongoing_requests >= 64
    from deployments.app import replica_options

    one_gpu = {"GPU": 1.0, "CPU": 16.0}  # the device machine: half the card each
    assert replica_options(args.small, one_gpu)["ray_actor_options"]["num_gpus"] == 0.5
    assert replica_options(args.large, one_gpu)["ray_actor_options"]["num_gpus"] == 0.5
    assert replica_options(args.ingress, one_gpu)["ray_actor_options"]["num_gpus"] == 0.0
    http_only = served_gpu.plan(served_gpu.parse(["--small", "S", "--large", "L", "--transports", "http"]))
    assert served_gpu.served_config(http_only, 1, 2)["grpc_options"]["grpc_servicer_functions"] == []
    assert config["grpc_options"]["grpc_servicer_functions"]


def test_ratios_and_the_token_check():
    tok = {"in_process": {"random b=0.9": {"1": 100.0, "16": 400.0}}, "http": {"random b=0.9": {"1": 90.0, "16": 0.0}},
           "grpc": {"random b=0.9": {"1": 95.0}, "always-large": {"1": 50.0}}}  # fmt: skip
    assert served_gpu.ratios(tok) == {"http": {"random b=0.9": {"1": 0.9}}, "grpc": {"random b=0.9": {"1": 0.95}}}
    check = served_gpu.compare({0: [1, 2, 3], 1: [4, 5], 2: [6]}, {0: [1, 2, 3], 1: [4, 9], 2: []})
    assert check == {"requests": 3, "equal": 1, "first_difference": {1: 1, 2: 0}}
    assert served_gpu.percentiles([0.001, 0.002, 0.003])["p50"] == pytest.approx(2.0)
    assert served_gpu.routing_params("random b=0.9").thresholds == (0.9,)
    assert served_gpu.routing_params("always-large").thresholds is None
