"""The static forward's decoder layer as ONE function compiled by inductor (torch.compile), for
the captured GPU step: fewer, larger kernels a layer (KVSpec.compile, "auto": where CUDA
graphs capture the forward).

Why: in a captured step every kernel costs ~2.5-4 us whatever its size. The eager layer is ~21
kernels for M_S (622 a step) and ~34 for M_L (1,108 a forward), so M_S ran at its launch floor
and M_L at 45% of the H200's HBM bandwidth. Inductor fuses everything between the GEMMs and the
attention into a few Triton kernels: the residual add with the next norm, the rotary
embedding with the K/V write into the slot storage and q's layout, SiLU with the gate
product. What stays apart: the four projection GEMMs (cuBLAS, over q/k/v and gate/up fused
as views of one buffer: `FusedLayer.shared`, no copy of the weights), the attention (`attend`)
and, on the gathered path, one copy of the rows' keys and values. Measured on an H200
(benchmarks/fused_step.py, both in one run): M_S's step 622 -> 355 kernels, 1.71 -> 1.11 ms
at one row over 256 keys; M_L's one-token forward 1,108 -> 441 kernels, 6.40 -> 4.64 ms.

The function takes the residual stream and the previous layer's MLP output apart (`h`,
`delta`: vLLM's `residual` convention), so the add lands in the same kernel as the norm that
reads it; the forward adds the last delta before the final norm.

Compiles are bounded and happen at load (CUDA graph warm-up), never in a replay: one function
for every layer of a model (weights are arguments of equal shapes in every layer), its token
dimensions marked dynamic (rows, k, the keys read L), so one compile serves every bucket of a
kind: a model compiles once per (rows 1 or more, k 1 or more, dense or gathered, `auto`'s
side of SDPA_MAX_KEYS) that its plan holds. Everything else (weights' shapes, heads, eps) is
specialised and guarded, so M_S and M_L never share a compile. On an H200 the default pair's
load took 162 s against 24 s eager (the compiles, Triton's autotuning and the captures);
inductor caches the compiled code on disk (TORCHINDUCTOR_CACHE_DIR), so a later load on the
same machine reads it.

Numbers: the same operations as `StaticForward`'s fused path; inductor keeps a fused chain's
intermediates in float32 (the residual sum's bf16 rounding before the norm is skipped), so in
bf16 the logits differ from the eager step by bf16's own noise (against HF's forward on the
random-weight 8B shape: 0.065 compiled, 0.041 eager), and in float32 they agree to float
rounding (tests/backoff_core/runners/test_static_compiled.py).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from backoff_core.types import COMPILE_MODES

# how a compiled layer attends (`attend`). SDPA's kernel on an H200 (cuDNN's flash kernel)
# parallelises over batch x heads x query blocks alone: a one-row step of M_S runs 3 blocks,
# each streaming every key, 17.6 us a layer over 1024 keys. HF's eager math (two batched GEMMs)
# spreads the keys over the GPU and is flat in their count, but costs two kernels more. Timed
# side by side (benchmarks/compiled_attention.py, an H200), M_S's step graph: 1 row over 256 /
# 1024 keys sdpa 1.09 / 1.42 ms, math 1.24 / 1.24; 64 rows 1.33 / 1.99 against 1.71 / 1.70;
# M_L's 1-row step 4.72 / 5.17 against 4.87 / 4.89. So "auto": SDPA up to SDPA_MAX_KEYS keys
# read, math past them (a forward's L is one length bucket: each side is its own compile).
ATTENTIONS = ("auto", "sdpa", "efficient", "math", "reduce")
ATTENTION = "auto"
SDPA_MAX_KEYS = 256

# one cache entry per (model, rows 1 or more, k 1 or more, dense or gathered, auto's side):
# two models at most sixteen each; dynamo's default of 8 would fall back to eager
RECOMPILE_LIMIT = 64


def decoder_layer(
    h: torch.Tensor,  # [B, K, d] the residual stream before this layer's attention
    delta: torch.Tensor,  # [B, K, d] the previous layer's MLP output (zeros before layer 0)
    kv: torch.Tensor,  # [2, S, kvh, M, D] this layer's stored keys and values (written in place)
    slots: torch.Tensor,  # [B] long: each row's slot
    positions: torch.Tensor,  # [B, K] long: each new token's position (and KV column)
    mask: torch.Tensor,  # [B, 1, G*K, L] additive, query rows ordered (g, k)
    cos: torch.Tensor,  # [B, K, D]
    sin: torch.Tensor,  # [B, K, D] rotate_half's negation folded into its first half
    in_norm: torch.Tensor,  # [d]
    qkv_w: torch.Tensor,  # [(H + 2 kvh) D, d]
    qkv_b: torch.Tensor | None,
    o_w: torch.Tensor,  # [d, H D]
    o_b: torch.Tensor | None,
    post_norm: torch.Tensor,  # [d]
    gate_up_w: torch.Tensor,  # [2 I, d]
    gate_up_b: torch.Tensor | None,
    down_w: torch.Tensor,  # [d, I]
    down_b: torch.Tensor | None,
    eps: float,
    heads: int,
    scaling: float,
    dense: bool,
    attention: str = ATTENTION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Llama decoder layer over static KV: returns (h + attention, the MLP's output)."""
    rows, k, width = h.shape
    kvh, d = kv.shape[2], kv.shape[4]
    g = heads // kvh
    h = h + delta
    x = in_norm * F.rms_norm(h, (width,), eps=eps)
    q, key, value = project_fused(x, qkv_w, qkv_b, cos, sin, heads, kvh, d)
    # in place at [:, slot, :, position]: the indexed result is [B, K, 2, kvh, D]
    kv[:, slots[:, None], :, positions] = torch.stack((key, value), dim=2)
    length = mask.shape[-1]
    stored = kv[:, :rows, :, :length] if dense else kv[:, slots, :, :length]  # [2, B, kvh, L, D]
    q = q.reshape(rows, k, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(rows, kvh, g * k, d)  # G folded into K
    out = attend(q, stored[0], stored[1], mask, scaling, attention)  # [B, kvh, G*K, D]
    out = out.view(rows, kvh, g, k, d).permute(0, 3, 1, 2, 4).reshape(rows, k, heads * d)
    h = h + F.linear(out, o_w, o_b)
    x = post_norm * F.rms_norm(h, (width,), eps=eps)
    gate, up = F.linear(x, gate_up_w, gate_up_b).chunk(2, dim=-1)
    return h, F.linear(F.silu(gate) * up, down_w, down_b)


def project_fused(x, qkv_w, qkv_b, cos, sin, heads: int, kvh: int, d: int):
    """x [B, K, d] -> q [B, K, H, D], key and value [B, K, kvh, D]: one GEMM over the fused
    q/k/v weights, and the rope over the q and k heads side by side. HF's q * cos +
    rotate_half(q) * sin, with rotate_half(x) = cat(-x2, x1): here cat(x2, x1) * cat(-sin1,
    sin2) (sin as StaticForward._rope_tables folds it), the same products ((-a) * b == a * (-b)
    exactly). The eager fused forward (StaticForward._project) and decoder_layer share it."""
    rows, k = x.shape[:2]
    qkv = F.linear(x, qkv_w, qkv_b)  # [B, K, (H + 2 kvh) D]
    qk = qkv[..., : (heads + kvh) * d].view(rows, k, heads + kvh, d)
    value = qkv[..., (heads + kvh) * d :].view(rows, k, kvh, d)
    half = d // 2
    swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
    qk = (qk * cos.unsqueeze(2)) + (swapped * sin.unsqueeze(2))
    return qk[:, :, :heads], qk[:, :, heads:], value


def attend(q, keys, values, mask, scale: float, how: str) -> torch.Tensor:
    """q [B, kvh, G*K, D] over keys, values [B, kvh, L, D] with the additive mask [B, 1, G*K, L]
    -> [B, kvh, G*K, D]. auto: sdpa up to SDPA_MAX_KEYS keys, math past them (measured
    above); sdpa: torch's SDPA (its own kernel choice); efficient: the
    memory-efficient kernel named (CUDA only); math: HF's eager attention (scores by a batched
    GEMM in the model's dtype, softmax in float32, a GEMM); reduce: the products summed in
    float32, which inductor writes as Triton reductions parallel over keys (no GEMM)."""
    if how == "auto":
        how = "sdpa" if keys.shape[-2] <= SDPA_MAX_KEYS else "math"
    if how == "sdpa":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    if how == "efficient":
        bias = mask.expand(-1, q.shape[1], -1, -1)
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, keys, values, bias, False, scale=scale)[0]
    if how == "math":
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale + mask  # [B, kvh, G*K, L]
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), values)
    if how == "reduce":
        scores = (q[:, :, :, None].float() * keys[:, :, None].float()).sum(-1) * scale + mask  # [B, kvh, G*K, L]
        probs = torch.softmax(scores, dim=-1)
        return (probs[..., None] * values[:, :, None].float()).sum(-2).to(q.dtype)
    raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {how!r}")


class CompiledLayers:
    """`decoder_layer` under torch.compile for one model, with its token dimensions marked
    dynamic at every call. Counts its compiles and their seconds (start-up's cost, reported)."""

    def __init__(self, name: str = "model", attention: str = ATTENTION) -> None:
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        self.name = name
        self.attention = attention
        self._fn = torch.compile(decoder_layer, fullgraph=True, dynamic=None)
        self.compiles = 0
        self.compile_s = 0.0
        self._seen: set[tuple] = set()

    def __call__(self, h, delta, kv, slots, positions, mask, cos, sin, *weights, dense: bool):
        """decoder_layer's arguments; call inside `settings()` (once a forward, not a layer)."""
        rows, k = positions.shape
        variant = (rows == 1, k == 1, dense, self.attention == "auto" and mask.shape[-1] <= SDPA_MAX_KEYS)
        start = time.perf_counter()
        _mark_tokens(h, delta, positions, slots, mask, cos, sin, rows, k)
        out = self._fn(h, delta, kv, slots, positions, mask, cos, sin, *weights, dense=dense, attention=self.attention)
        if variant not in self._seen:  # its first call compiled (or read inductor's cache)
            self._seen.add(variant)
            self.compiles += 1
            self.compile_s += time.perf_counter() - start
        return out

    @staticmethod
    def settings():
        """Only the marked dimensions dynamic (no automatic dynamic: a second model's weights
        would otherwise turn the first one's shapes symbolic), and room for every variant of
        two models."""
        cfg = torch._dynamo.config
        limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # its older name
        return cfg.patch(automatic_dynamic_shapes=False, **{limit: max(getattr(cfg, limit), RECOMPILE_LIMIT)})


def _mark_tokens(h, delta, positions, slots, mask, cos, sin, rows: int, k: int) -> None:
    """rows, k and the keys read as dynamic dimensions (where > 1: dynamo specialises 0 and 1),
    so one compile serves every bucket of a kind."""
    mark = torch._dynamo.maybe_mark_dynamic  # no error where the trace needs a constant
    if rows > 1:
        for t in (h, delta, positions, slots, mask, cos, sin):
            mark(t, 0)
    if k > 1:
        for t in (h, delta, positions, cos, sin):
            mark(t, 1)
        mark(mask, 2)  # G * K
    mark(mask, 3)  # L, the keys read


def resolve(mode: str, device: torch.device, cuda_graphs: bool) -> bool:
    """Whether a static runner compiles its layers: "on" always (the CPU compiles C++), "auto"
    where the forward is captured in CUDA graphs (compiled once at load, replayed after),
    "off" never."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == "auto":
        return device.type == "cuda" and cuda_graphs
    return mode == "on"
