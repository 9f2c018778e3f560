"""The GPU memory and graph plan of the benchmark pair at real shapes, without weights.

    python benchmarks/gpu_plan.py              # -> benchmarks/results/gpu/plan.json
                                               #    and plan_tensor_parallel.json (below)
    python benchmarks/gpu_plan.py --pair paper # the same plan.json; prints its "paper" part

Builds the 135M- and 8B-shaped models of ../shared/gpu/make_pair.py on the meta device (no
memory, no weights) and a StaticRunner's storage and graph plan for each at the defaults
of scripts/gpu_bench.sh (KV_BUDGET tokens per model in slots of MAX_LEN, bf16), exactly as
factory.make_runner would: M_S graphs for k = 1, 2 (last logits only), M_L every catch-up
kind within graph_plan.GRAPH_BUDGET, its ragged catch-ups' token buckets included (KVSpec
ragged "auto", the default on CUDA). Writes
    {"models": {name: {"graphs", "kv_gib", "weights_gib", "pool_gib", "fused_gib"}}, "total_gib"}
fused_gib: M_S's fused q/k/v and gate/up copies (static_forward.py; M_L keeps its modules).
pool_gib estimates what capturing adds beside the KV storage: the graphs' static output
buffers, their shared memory pool (captured largest first, every intermediate dying inside
its graph: about the peak activations of the largest bucket, estimate_pool below) and as
much again cached by the allocator from the warm-up run before each capture. Measured on
an H100 (gpu_check.json): 0.19 GiB (M_S) and 0.43 GiB (M_L) against 0.16 and 0.56 here.
tests/backoff_core/runners/test_gpu_plan.py holds these figures (<= 200 graphs per model,
the pair within 70 GiB); scripts/gpu_bench.sh tests measures them on the GPU.

plan.json's "paper" (plan_paper): the paper's own pair on ONE H200, Llama-3.1-8B-shaped M_S and
Llama-3.1-70B-shaped M_L (128256 vocabulary, GQA 8 KV heads), the decoders' linear layers in fp8
as `--quantize-small/--quantize-large fp8` hold them (backoff_core/models/fp8.py: a byte a
parameter plus a float32 scale a 128 x 128 block; embeddings, norms and LM heads in bf16), bf16 KV
for the same 64 streams x 1024 positions, both within the graph budget; it fits where at least 5%
of the card (SPARE) is left after HEADROOM_GIB. The fp8 models hold no fused q/k/v copies
(FP8Linear layers are not fused). tests/backoff_core/runners/test_gpu_plan.py holds it.

plan_tensor_parallel.json: one rank of the paper's M_L (Llama-3.1-70B's shape, DESIGN.md §4)
split over TP ranks as backoff_core/parallel/sharding.py splits it (1/N of every layer and of
the LM head's vocabulary, the embedding whole on every rank, 8/N KV heads), its static KV at
the same budget and slots, in bf16 at TP=4 and with fp8 weights (KV in bf16) at TP=2, against
an 80 GB H100 (74.5 GiB, less HEADROOM_GIB for the CUDA context and NCCL's buffers); and the
paper's M_S (Llama-3.1-8B) on one GPU beside them (docs/cluster.md: the pair on one 8-GPU node).
tests/backoff_core/parallel/test_gpu_plan_tensor_parallel.py holds them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backoff_core.models.fp8 import fp8_layers, quantize_model
from backoff_core.runners.graph_plan import GRAPH_BUDGET, K_BUCKETS, GraphKey, kinds, plan_keys
from backoff_core.runners.static_forward import StaticForward
from backoff_core.runners.static_kv import StaticKV
from backoff_core.runners.static_ragged import RAGGED_TOKENS

# make_pair.py's shapes (SmolLM2-135M, Llama-3-8B) with the SmolLM2 tokenizer's vocabulary
VOCAB = 49152
SHAPES = {
    "small": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    ),
    "large": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
}
# the paper's pair (public configs, DESIGN.md §4): Llama-3.1-8B (M_S) and -70B (M_L)
PAPER = {
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
    ),
    "llama-3.1-70b": dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
    ),
}  # fmt: skip
PAPER_VOCAB = 128256
H100_GIB = 80e9 / 2**30  # 74.5
H200_GIB = 143771 / 1024  # 140.4: nvidia-smi's total on the H200 we measure on (gpu.txt)
SPARE = 0.05  # the paper's pair on one H200: at least this share of the card left free
HEADROOM_GIB = 4.0  # CUDA context, NCCL's buffers, fragmentation
TP_PLANS = (("llama-3.1-70b", 4, "bfloat16"), ("llama-3.1-70b", 2, "fp8"), ("llama-3.1-8b", 1, "bfloat16"))
KV_BUDGET = 65536  # scripts/gpu_bench.sh: --kv-budget
MAX_LEN = 1024  # scripts/gpu_bench.sh: --max-len
GRAPH_MAX_ROWS = 64  # StaticRunner's default
GIB = 2**30


def meta_model(name: str) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=8192, **SHAPES[name])
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def estimate_pool(config, key: GraphKey, element: int, vocab: int = VOCAB) -> int:
    """Bytes alive at the peak of one forward of this bucket (static_forward.py), an upper
    estimate: the residual stream and a normed copy, q/k/v/attention output, the MLP's gate,
    up and product, the additive mask, cos/sin, a gathered batch's K and V, and the logits
    with their float32 copy (made outside the graph, from the pool's neighbour)."""
    d, inner = config.hidden_size, config.intermediate_size
    heads, kvh = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads  # a rank's shard: its heads, not d / heads
    tokens = key.rows * key.k
    out = key.rows * (1 if key.last_only else key.k)
    per_token = 2 * d + (heads + 2 * kvh) * head_dim + d + 3 * inner + 2 * head_dim
    mask = key.rows * heads // kvh * key.k * key.length
    gather = 0 if key.dense else 2 * key.rows * kvh * key.length * head_dim
    return (tokens * per_token + mask + gather + out * vocab) * element + out * vocab * 4


def plan_model(name: str, kv_budget: int = KV_BUDGET, max_len: int = MAX_LEN) -> dict:
    return plan_of(meta_model(name), name, name == "small", kv_budget, max_len)


def plan_of(model, name: str, small: bool, kv_budget: int, max_len: int) -> dict:
    """One model's graphs and memory as factory.make_runner would hold it (its KV in its dtype)."""
    kv = StaticKV(model, kv_budget, max_len, name)
    element = 2  # bf16 activations and KV
    vocab = model.config.vocab_size
    # M_L's catch-ups ragged where timed faster (KVSpec ragged "auto", the default on CUDA): one
    # graph per token bucket that CudaGraphs' buffers hold, within the budget (StaticRunner.warmup)
    wanted = kinds((None,), (True,), (1, 2)) if small else kinds((None,), (True, False), K_BUCKETS, ragged=True)
    rows = min(GRAPH_MAX_ROWS, 1 << max(0, kv.slots - 1).bit_length())
    ragged = [] if small else [t for t in RAGGED_TOKENS if t <= rows * K_BUCKETS[-1]]
    keys = plan_keys(kv.slots, max_len, rows, wanted, GRAPH_BUDGET - len(ragged))
    buffers = rows * K_BUCKETS[-1] * (vocab + model.config.hidden_size) * element  # CudaGraphs' outputs
    # a ragged forward of t tokens: a one-row forward's activations of t tokens, no mask of L
    # (its block mask is a few KB), and its rows' logits (the buffers above)
    peaks = [estimate_pool(model.config, k, element, vocab) for k in keys]
    peaks += [estimate_pool(model.config, GraphKey(True, 1, t, 0, True, None), element, vocab) for t in ragged]
    pool = 2 * max(peaks) + buffers
    fused = StaticForward(model, kv, fuse_projections=small).fused_nbytes()  # as factory.make_runner
    return {
        "graphs": len(keys) + len(ragged),
        "ragged_graphs": len(ragged),
        "slots": kv.slots,
        "kv_gib": round(kv.nbytes() / GIB, 3),
        "weights_gib": round(weight_bytes(model) / GIB, 3),
        "pool_gib": round(pool / GIB, 3),
        "fused_gib": round(fused / GIB, 3),
    }


def weight_bytes(model) -> int:
    """The parameters' bytes and, of fp8 layers, their e4m3 weights and float32 scales."""
    fp8 = [t for m in fp8_layers(model) for t in (m.weight, m.weight_scale_inv)]
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *fp8])


def plan(kv_budget: int = KV_BUDGET, max_len: int = MAX_LEN) -> dict:
    """The benchmark pair's plan and, beside it, the paper's (`paper`: plan_paper)."""
    return {**plan_default(kv_budget, max_len), "paper": plan_paper(kv_budget, max_len)}


def plan_default(kv_budget: int = KV_BUDGET, max_len: int = MAX_LEN) -> dict:
    models = {name: plan_model(name, kv_budget, max_len) for name in SHAPES}
    total = sum(m["kv_gib"] + m["weights_gib"] + m["pool_gib"] + m["fused_gib"] for m in models.values())
    return {
        "models": models,
        "total_gib": round(total, 3),
        "kv_budget_tokens": kv_budget,
        "max_len": max_len,
        "dtype": "bfloat16",
    }


def paper_model(name: str, quantize: str = "fp8") -> LlamaForCausalLM:
    """A PAPER model on the meta device in bf16, its decoder's linear layers in fp8 as
    `--quantize-* fp8` holds them (fp8.quantize_model, run on meta: shapes and dtypes only)."""
    config = LlamaConfig(vocab_size=PAPER_VOCAB, max_position_embeddings=131072, **PAPER[name])
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return quantize_model(model) if quantize == "fp8" else model


def plan_paper(kv_budget: int = KV_BUDGET, max_len: int = MAX_LEN, quantize: str = "fp8") -> dict:
    """The paper's pair on one H200: Llama-3.1-8B-shaped M_S and -70B-shaped M_L, fp8 weights
    (embeddings, norms, LM head in bf16), bf16 KV for kv_budget positions in slots of max_len,
    both models' graphs within the budget. fits_h200: total + HEADROOM_GIB leaves >= SPARE of
    the card free."""
    models = {
        role: {"model": name, **plan_of(paper_model(name, quantize), name, role == "small", kv_budget, max_len)}
        for role, name in (("small", "llama-3.1-8b"), ("large", "llama-3.1-70b"))
    }
    total = sum(m["kv_gib"] + m["weights_gib"] + m["pool_gib"] + m["fused_gib"] for m in models.values())
    free = H200_GIB - HEADROOM_GIB - total
    return {
        "models": models,
        "total_gib": round(total, 3),
        "gpu": "H200 (143771 MiB, gpu.txt)",
        "gpu_gib": round(H200_GIB, 3),
        "headroom_gib": HEADROOM_GIB,
        "free_gib": round(free, 3),
        "spare": round(free / H200_GIB, 4),
        "fits_h200": free / H200_GIB >= SPARE,
        "kv_budget_tokens": kv_budget,
        "max_len": max_len,
        "weights": quantize,
        "kv_dtype": "bfloat16",
    }


def rank_model(name: str, size: int) -> LlamaForCausalLM:
    """One rank's shard of a PAPER model on the meta device (sharding.py's config: its heads,
    KV heads and MLP width; the LM head's ceil(V/N) rows), in bf16."""
    from backoff_core.parallel.sharding import _shard_config, layout

    config = LlamaConfig(vocab_size=PAPER_VOCAB, max_position_embeddings=131072, **PAPER[name])
    shard_config = _shard_config(config, layout(config, name, size)) if size > 1 else config
    with torch.device("meta"):
        model = LlamaForCausalLM(shard_config)
        model.lm_head = torch.nn.Linear(config.hidden_size, -(-PAPER_VOCAB // size), bias=False)
        return model.to(torch.bfloat16)


def plan_rank(name: str, size: int, weights: str, kv_budget: int = KV_BUDGET, max_len: int = MAX_LEN) -> dict:
    """One rank's memory: weights (fp8: a byte a parameter), static KV (bf16), graph pool."""
    model = rank_model(name, size)
    kv = StaticKV(model, kv_budget, max_len, name)
    rows = min(GRAPH_MAX_ROWS, 1 << max(0, kv.slots - 1).bit_length())
    keys = plan_keys(kv.slots, max_len, rows, kinds((None,), (True, False), K_BUCKETS), GRAPH_BUDGET)
    pool = 2 * max(estimate_pool(model.config, k, 2) for k in keys)
    params = sum(p.numel() for p in model.parameters())
    weights_gib = params * (1 if weights == "fp8" else 2) / GIB
    total = weights_gib + kv.nbytes() / GIB + pool / GIB
    return {
        "model": name,
        "tensor_parallel": size,
        "weights": weights,
        "kv_heads_per_rank": model.config.num_key_value_heads,
        "weights_gib": round(weights_gib, 3),
        "kv_gib": round(kv.nbytes() / GIB, 3),
        "pool_gib": round(pool / GIB, 3),
        "total_gib": round(total, 3),
        "fits_h100_80gb": total + HEADROOM_GIB <= H100_GIB,
        "free_gib": round(H100_GIB - HEADROOM_GIB - total, 3),
    }


def plan_tensor_parallel(kv_budget: int = KV_BUDGET, max_len: int = MAX_LEN) -> dict:
    ranks = [plan_rank(name, size, weights, kv_budget, max_len) for name, size, weights in TP_PLANS]
    return {
        "per_rank": ranks,
        "gpu": "H100 80 GB",
        "gpu_gib": round(H100_GIB, 3),
        "headroom_gib": HEADROOM_GIB,
        "kv_budget_tokens": kv_budget,
        "max_len": max_len,
        "kv_dtype": "bfloat16",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--pair",
        choices=("default", "paper", "all"),
        default="all",
        help="what to print: the benchmark pair, the paper's on one H200, or both with the tensor-parallel "
        "plan (plan.json always holds the first two)",
    )
    args = p.parse_args(argv)
    out = Path("benchmarks/results/gpu/plan.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = plan()
    out.write_text(json.dumps(result, indent=2) + "\n")
    shown = {"default": {k: v for k, v in result.items() if k != "paper"}, "paper": result["paper"]}
    print(json.dumps(shown.get(args.pair, result), indent=2))
    if args.pair == "all":
        tp = plan_tensor_parallel()
        (out.parent / "plan_tensor_parallel.json").write_text(json.dumps(tp, indent=2) + "\n")
        print(json.dumps(tp, indent=2))


if __name__ == "__main__":
    main()
