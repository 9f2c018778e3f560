"""`quantize` in the Serve config and on `backoff serve` (models_config.Quantization,
docs/fp8.md): which model is fp8, what a replica's loader is asked for, and the errors. No Ray."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from backoff_core.models.fp8 import fp8_layers
from deployments.serve_cli import DEFAULT_CONFIG, _parser, apply_overrides
from deployments.serving import models
from deployments.serving.config import AppArgs
from deployments.serving.models_config import ModelsConfig, Quantization
from tests.support.tiny import tiny_model


def test_each_model_has_its_own_and_one_value_sets_both():
    assert ModelsConfig().quantize == Quantization(small="none", large="none")
    assert ModelsConfig(quantize={"large": "fp8"}).quantize == Quantization(small="none", large="fp8")
    assert ModelsConfig(quantize="fp8").quantize == Quantization(small="fp8", large="fp8")
    spec = models._spec(ModelsConfig(quantize={"small": "fp8"}))
    assert (spec.quantize_small, spec.quantize_large) == ("fp8", "none")


def test_bad_values_are_refused_naming_the_choices():
    with pytest.raises(ValidationError, match="'none' or 'fp8'"):
        ModelsConfig(quantize={"large": "int4"})
    with pytest.raises(ValidationError, match="huge"):
        ModelsConfig(quantize={"huge": "fp8"})
    with pytest.raises(ValidationError, match="fp8 over tensor-parallel ranks is not built yet"):
        ModelsConfig(quantize={"large": "fp8"}, tensor_parallel={"large": 2})


def test_backoff_serve_flags_set_the_config(capsys):
    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config = apply_overrides(base, _parser().parse_args(["--quantize-large", "fp8"]))
    assert AppArgs.model_validate(config["applications"][0]["args"]).models.quantize == Quantization(large="fp8")
    base["applications"][0].setdefault("args", {}).setdefault("models", {})["quantize"] = "fp8"
    config = apply_overrides(base, _parser().parse_args(["--quantize-small", "none"]))
    assert AppArgs.model_validate(config["applications"][0]["args"]).models.quantize == Quantization(large="fp8")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--quantize-small", "fp16"])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_a_replica_loads_its_level_in_fp8(tmp_path, tokenizer):
    for name, model in (("small", tiny_model(1)), ("large", tiny_model(2, hidden=64, layers=4))):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    cfg = ModelsConfig(
        small=str(tmp_path / "small"), large=str(tmp_path / "large"), device="cpu", quantize={"large": "fp8"}
    )
    assert len(fp8_layers(models.load_level(cfg, 1))) == 7 * 4
    assert not fp8_layers(models.load_small_side(cfg).model)
