"""fp8 on a GPU with fp8 tensor cores (H100/H200): the W8A8 GEMM (F.scaled_mm) is found by the
probe and computes the CPU's emulation of it; an fp8 model's forward and greedy tokens; the
random-weight builder at the 8B shape. `pytest -m cuda` (scripts/gpu_bench.sh tests)."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig

from backoff_core.models.fp8 import (
    FP8Linear,
    fake_quantize_activations,
    fp8_layers,
    quantize_model,
    quantize_weight,
    scaled_mm_works,
)
from backoff_core.models.random_fp8 import random_model
from benchmarks.gpu_plan import PAPER, PAPER_VOCAB
from tests.support.cuda_shapes import cuda_only

FP8_CARD = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_card = pytest.mark.skipif(not FP8_CARD, reason="needs fp8 tensor cores (compute capability >= 8.9)")


@cuda_only
@needs_fp8_card
@pytest.mark.parametrize("block", [(128, 128), (1, 512)], ids=["blockwise", "rowwise"])
def test_w8a8_gemm_is_the_emulation(block):
    recipe = "blockwise" if block == (128, 128) else "rowwise"
    assert scaled_mm_works(torch.device("cuda"), recipe)
    w = torch.randn(1024, 512, device="cuda")
    layer = FP8Linear(*quantize_weight(w, block), block)
    assert layer.kernel == "scaled_mm" and layer.activations == "fp8"
    for rows in (1, 7, 64):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        want = torch.nn.functional.linear(
            fake_quantize_activations(x.float(), layer.activation_block), layer.dequantized()
        )
        got = layer(x).float()
        assert ((got - want).norm() / want.norm()).item() < 0.01


@cuda_only
@needs_fp8_card
def test_an_fp8_model_on_the_gpu_runs_w8a8_with_the_emulations_numbers():
    config = LlamaConfig(vocab_size=48, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    model = quantize_model(random_model(config, device="cuda", quantize="none", seed=1))
    layers = fp8_layers(model)
    assert all(layer.kernel == "scaled_mm" and layer.activations == "fp8" for layer in layers)
    ids = torch.tensor([[3, 4, 5, 6, 7]], device="cuda")
    with torch.no_grad():
        gemm = model(ids).logits.float()
        for layer in layers:
            layer.kernel = "dequantize"  # the CPU's emulation of the same W8A8, same stored weights
        emulated = model(ids).logits.float()
    assert ((gemm - emulated).norm() / emulated.norm()).item() < 0.02


@cuda_only
def test_the_8b_shape_builds_straight_into_fp8_fast():
    config = LlamaConfig(vocab_size=PAPER_VOCAB, max_position_embeddings=8192, **PAPER["llama-3.1-8b"])
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = random_model(config, device="cuda")
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30
    assert len(fp8_layers(model)) == 32 * 7
    print(f"8B-shaped fp8 build: {seconds:.1f} s, peak {peak:.2f} GiB")
    assert seconds < 60 and peak < 8.5 + 1.0  # its 8.46 GiB plus one float32 matrix, not a bf16 copy (16 GB)
