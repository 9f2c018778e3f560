"""The CUDA tests' shared inputs: prompts, two-layer models with the attention of the real
models (bf16 at G=3 and G=4), and the devices they run on, for test_static_cuda.py and
test_static_ragged_cuda.py.

Each of those tests runs on the GPU (marked `cuda`: `pytest -m cuda`, scripts/gpu_bench.sh
tests) and, rehearsed, on the CPU in every run of the suite: the same test over the same
runners, their CUDA graphs' bookkeeping replayed eagerly (EagerGraphs: the buckets, static
inputs, layouts and replay counts of the real thing), so an expectation that does not hold
fails here and not on a GPU's first run. What only a GPU has (CUDA streams, events, kernels)
is tested on the GPU alone (`cuda_only`, or a test that skips its CPU half)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backoff_core.runners.graph_plan import K_BUCKETS
from backoff_core.runners.static import StaticRunner
from tests.support.eager_graphs import EagerGraphs
from tests.support.tiny import VOCAB

CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = [pytest.param("cuda", marks=CUDA_ONLY, id="cuda"), pytest.param("cpu", id="cpu-rehearsal")]


def cuda_only(test):
    """A test of what only a GPU has: marked `cuda`, skipped without one, not rehearsed."""
    for mark in CUDA_ONLY:
        test = mark(test)
    return test


def with_graphs(run: StaticRunner) -> StaticRunner:
    """The runner's CUDA graphs: captured on the GPU; on the CPU rehearsal, EagerGraphs."""
    if run.graphs is None and run.device.type == "cpu":
        run.graphs = EagerGraphs(run._forward, run.graph_max_rows, K_BUCKETS[-1])
    return run


PROMPTS = [(3, 4, 5, 6), (7,), (9, 9, 9, 9, 9, 9, 9, 1)]
LONG = tuple((5 * i + 1) % 48 for i in range(40))  # k = 40 > 16: an eager prefill

SHAPES = {  # G = heads / kv_heads; head_dim = hidden / heads
    "G3-135M": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536),
    "G4-8B": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=2048),
}


# the shapes as test parameters: the 8B attention's CPU rehearsal takes seconds (bf16 matmuls at
# hidden 4096), so it is `slow` (make test runs it, make test-fast does not)
SHAPE_PARAMS = [pytest.param(shape, marks=[pytest.mark.slow] if "8B" in shape else []) for shape in SHAPES]


def shaped_model(shape: str, device: str) -> LlamaForCausalLM:
    """Two layers with the attention of a real model (rope theta and all), random weights."""
    torch.manual_seed(11)
    config = LlamaConfig(
        vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=2048, tie_word_embeddings=False, **SHAPES[shape]
    )
    with torch.device(device):
        return LlamaForCausalLM(config).eval()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())
