"""`backoff generate`'s routing: with none named, the packaged default routing (the serve
config's); whatever the user names is taken as given."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from backoff_core.cli.main import _parser, main, request_from_args
from backoff_core.evaluation.frontier_spec import DEFAULT_ROUTING

ROOT = Path(__file__).resolve().parents[3]


def _routing(*argv: str):
    args = _parser().parse_args(["generate", "--prompt", "hello", *argv])
    return request_from_args(args, [1, 2, 3]).routing


def test_no_routing_named_is_the_serve_configs_default():
    config = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    small = next(d for d in config["applications"][0]["deployments"] if d["name"] == "SmallModel")
    routing = _routing()
    assert (routing.router, routing.thresholds) == (DEFAULT_ROUTING.router, DEFAULT_ROUTING.thresholds)
    assert routing.router == small["user_config"]["router"]
    assert list(routing.thresholds) == list(small["user_config"]["thresholds"])


def test_what_the_user_names_is_kept():
    assert _routing("--router", "entropy").thresholds is None  # the router's own default
    assert _routing("--threshold", "2.5").thresholds == (2.5,)
    assert _routing("--threshold", "2.5").router == DEFAULT_ROUTING.router
    assert _routing("--medium", "m", "--threshold", "1, 2.5").thresholds == (1.0, 2.5)
    random = _routing("--router", "random", "--rate", "0.3")
    assert (random.router, random.rate, random.thresholds) == ("random", 0.3, None)
    assert _routing("--target-backoff", "0.4").thresholds is None
    assert _routing("--medium", "m").thresholds is None  # a chain of three: one threshold would not fit


def test_bad_thresholds_are_a_clear_cli_error(capsys):
    """parse_thresholds' refusal as argparse's usage error (exit 2), before any model loads."""
    for value, says in (("2,1", "ascending, got [2.0, 1.0]"), ("2,x", "numbers separated by commas")):
        with pytest.raises(SystemExit) as exit_:
            main(["generate", "--prompt", "hello", "--threshold", value])
        assert exit_.value.code == 2
        assert f"argument --threshold: thresholds must be {says}" in capsys.readouterr().err
    assert _routing("--threshold", "").thresholds == DEFAULT_ROUTING.thresholds  # "" names none


def _static_generate(tmp_path, pair, tokenizer, *extra: str) -> list[str]:
    """`backoff generate`'s arguments over the pair saved to tmp_path: random routing at 0.6,
    seeded, static KV (8 slots of 64), --json; `extra` added."""
    for model, name in zip(pair, ("small", "large")):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    argv = ["generate", "--small", str(tmp_path / "small"), "--large", str(tmp_path / "large"), "--prompt", "w3 w4"]
    return argv + [
        "--router",
        "random",
        "--rate",
        "0.6",
        "--seed",
        "3",
        "--kv-budget",
        "512",
        "--max-len",
        "64",
        "--json",
        *extra,
    ]


def test_generate_launched_ahead_prints_the_same_tokens_and_needs_static_kv(tmp_path, pair, tokenizer, capsys):
    """`backoff generate --launch-ahead` (engine/ahead.py) over static KV: the tokens and sources
    of the run without (auto, the default: off on the CPU; false); without --kv-budget it is
    refused with the flag to give, where auto runs without."""
    import json
    from unittest import mock

    import pytest

    from backoff_core.cli.main import main
    from backoff_core.engine import ahead

    argv = _static_generate(tmp_path, pair, tokenizer, "--temperature", "0.9", "--max-tokens", "10")
    runs = []
    launched = []
    real_resolve = ahead.resolve

    def resolve(setting, model, overlap_catch_ups=False):
        launched.append(real_resolve(setting, model, overlap_catch_ups))
        return launched[-1]

    with mock.patch.object(ahead, "resolve", resolve):
        for extra in ([], ["--launch-ahead"], ["--launch-ahead", "false"]):
            assert main(argv + extra) == 0
            out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            runs.append((out["token_ids"], out["sources"]))
    assert launched == [False, True, False]
    assert runs[0] == runs[1] == runs[2] and len(runs[0][0]) == 10
    without_kv = [a for a in argv if a not in ("--kv-budget", "512")]
    with pytest.raises(SystemExit, match="--launch-ahead needs static KV: give --kv-budget"):
        main(without_kv + ["--launch-ahead"])
    assert main(without_kv) == 0 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]


def test_generate_with_compiled_layers_prints_the_same_tokens(tmp_path, pair, tokenizer, capsys):
    """`backoff generate --compile-layers on` (runners/static_compiled.py; inductor's C++ on the
    CPU, plain Linear modules) prints the tokens of the eager static forward; the mode reaches
    both models' runners (auto: off on the CPU)."""
    import json
    from unittest import mock

    from backoff_core.cli.main import main
    from backoff_core.runners import factory

    argv = _static_generate(tmp_path, pair, tokenizer, "--max-tokens", "8", "--cpu-kernels", "default")
    chosen, runs = [], []
    real = factory.resolve_compile

    def resolve(mode, device, graphs):
        chosen.append(real(mode, device, graphs))
        return chosen[-1]

    with mock.patch.object(factory, "resolve_compile", resolve):
        for extra in ([], ["--compile-layers", "on"]):
            assert main(argv + extra) == 0
            out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            runs.append((out["token_ids"], out["sources"]))
    assert chosen == [False, False, True, True]
    assert runs[0] == runs[1] and len(runs[0][0]) == 8
