"""The random-weight builder straight into fp8 (backoff_core/models/random_fp8.py): at a tiny
shape on the CPU the same bytes as drawing the dense model and quantising it after; at the
paper's 70B shape on the meta device the layers, dtypes and bytes gpu_plan.py plans for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from backoff_core.models.fp8 import FP8, fp8_layers, quantize_model
from backoff_core.models.random_fp8 import random_model
from benchmarks.gpu_plan import PAPER, PAPER_VOCAB, weight_bytes
from tests.support.tiny import TINY_SHAPE

PLAN = Path(__file__).parents[3] / "benchmarks" / "results" / "gpu" / "plan.json"


def _tiny() -> LlamaConfig:
    return LlamaConfig(**{**TINY_SHAPE, "hidden_size": 128, "intermediate_size": 256})


def test_built_in_fp8_is_the_dense_draw_quantised():
    fp8 = random_model(_tiny(), dtype=torch.float32, quantize="fp8", seed=3)
    dense = random_model(_tiny(), dtype=torch.float32, quantize="none", seed=3)
    assert not fp8_layers(dense)
    reference = quantize_model(dense)
    built, want = dict(fp8.named_modules()), dict(reference.named_modules())
    assert len(fp8_layers(fp8)) == 7 * 2
    for layer in fp8_layers(reference):
        name = next(n for n, m in want.items() if m is layer)
        assert torch.equal(built[name].weight.view(torch.uint8), layer.weight.view(torch.uint8))
        assert torch.equal(built[name].weight_scale_inv, layer.weight_scale_inv)
    assert torch.equal(fp8.lm_head.weight, reference.lm_head.weight)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        logits = fp8(ids).logits
    assert torch.isfinite(logits).all() and torch.equal(logits, reference(ids).logits)
    assert not torch.equal(fp8.lm_head.weight, random_model(_tiny(), dtype=torch.float32, seed=4).lm_head.weight)


def test_the_papers_70b_shape_on_meta_is_what_the_plan_holds():
    config = LlamaConfig(vocab_size=PAPER_VOCAB, max_position_embeddings=131072, **PAPER["llama-3.1-70b"])
    model = random_model(config, device="meta")
    layers = fp8_layers(model)
    assert len(layers) == 80 * 7 and all(layer.weight.dtype == FP8 for layer in layers)
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.bfloat16
    planned = json.loads(PLAN.read_text())["paper"]["models"]["large"]["weights_gib"]
    assert weight_bytes(model) / 2**30 == pytest.approx(planned, abs=1e-3)


def test_an_unknown_module_is_refused_by_name():
    config = LlamaConfig(**{**TINY_SHAPE, "attention_bias": True})
    for quantize in ("none", "fp8"):
        with pytest.raises(ValueError, match="not drawn: .*q_proj.bias"):
            random_model(config, quantize=quantize)
