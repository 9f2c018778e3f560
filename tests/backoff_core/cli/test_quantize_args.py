"""`--quantize-small / --quantize-large` on `backoff generate`, `frontier` and `lm-eval` reach
the loader (docs/fp8.md); a bad value is a clear error."""

from __future__ import annotations

import json

import pytest
import torch

from backoff_core.cli.args import load_spec
from backoff_core.cli.frontier import _quantized_names, quantize_into_model_args
from backoff_core.cli.main import _parser, main
from backoff_core.models.fp8 import fp8_layers, quantize_model
from backoff_core.models.loading import LoadSpec, load_chain
from tests.support.helpers import hf_greedy
from tests.support.tiny import tiny_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("quantize")
    paths = {}
    for name, model in (("small", tiny_model(1, sharpness=30)), ("large", tiny_model(2, hidden=128, sharpness=30))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def test_flags_reach_the_load_spec_and_the_chain(dirs):
    argv = ["generate", "--prompt", "x", "--small", dirs["small"], "--large", dirs["large"], "--quantize-large", "fp8"]
    args = _parser().parse_args(argv)
    spec = load_spec(args)
    assert (spec.quantize_small, spec.quantize_large) == ("none", "fp8")
    chain = load_chain(args.small, args.large, (), spec)
    assert not fp8_layers(chain.models[0]) and len(fp8_layers(chain.models[1])) == 7 * 2
    assert load_spec(_parser().parse_args(["frontier", "--quantize-small", "fp8"])).quantize_small == "fp8"
    names = _quantized_names(("s", "l"), _parser().parse_args(["frontier", "--quantize-large", "fp8"]))
    assert names == ["s", "l:fp8"]  # the frontier's cached rows of the fp8 pair are not the full pair's


def test_generate_prints_the_fp8_models_own_greedy_tokens(dirs, capsys):
    code = main(["generate", "--small", dirs["small"], "--large", dirs["large"], "--quantize-large", "fp8",
        "--router", "always-large", "--prompt", "w3 w4 w5", "--max-tokens", "10", "--json"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    large = quantize_model(tiny_model(2, hidden=128, sharpness=30))
    prompt = load_chain(dirs["small"], dirs["large"], (), LoadSpec()).tokenizer("w3 w4 w5")["input_ids"]
    assert out["token_ids"] == list(hf_greedy(large, prompt, 10))


def test_bad_values_are_clear_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["generate", "--quantize-large", "int4"])
    assert exc.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quantize_large must be one of none, fp8, got 'int4'"):
        LoadSpec(quantize_large="int4")
    with pytest.raises(SystemExit, match="--quantize-large fp8 over --large-tp ranks is not built yet"):
        main(["generate", "--prompt", "x", "--quantize-large", "fp8", "--large-tp", "2"])
    with pytest.raises(ValueError, match="--quantize-small must be one of none, fp8, got 'fp4'"):
        quantize_into_model_args(["--quantize-small", "fp4"])


def test_lm_eval_flags_become_the_backoff_models_model_args():
    argv = ["--model", "backoff", "--quantize-large", "fp8", "--tasks", "t", "--model_args", "router=always-large"]
    assert quantize_into_model_args(argv) == [
        "--model", "backoff", "--tasks", "t", "--model_args", "router=always-large,quantize_large=fp8",
    ]  # fmt: skip
    assert quantize_into_model_args(["--quantize-small=fp8", "--tasks", "t"]) == [
        "--tasks", "t", "--model_args", "quantize_small=fp8",
    ]  # fmt: skip
    assert quantize_into_model_args(["--model_args=a=1", "--quantize-large", "none"]) == [
        "--model_args=a=1,quantize_large=none"
    ]
    assert quantize_into_model_args(["--tasks", "t"]) == ["--tasks", "t"]


def test_lm_eval_model_loads_the_fp8_model(dirs):
    pytest.importorskip("lm_eval")
    from backoff_core.evaluation.lm_model import BackoffLM

    lm = BackoffLM(small=dirs["small"], large=dirs["large"], quantize_large="fp8", router="always-large")
    large = lm.engine.models[1].model
    assert len(fp8_layers(large)) == 14 and not fp8_layers(lm.engine.models[0].model)
    ids = torch.tensor([[3, 4, 5]])
    reference = quantize_model(tiny_model(2, hidden=128, sharpness=30))
    with torch.no_grad():
        torch.testing.assert_close(large(ids).logits, reference(ids).logits)
