"""The forward pass over static KV storage (gpt-fast style), built from the HF model's OWN
modules so the weights, norms, MLP and rotary embedding (rope scaling included) are
exactly the model's: only the attention's cache handling is ours.

Per layer: norm -> q/k/v projections -> HF's own `apply_rotary_pos_emb` with cos/sin from
`model.model.rotary_emb` -> write the new k/v in place at [row's slot, row's positions]
-> SDPA over the stored keys [0, L) with an additive mask (0 where key j is visible to the
query at position p, i.e. j <= p, -inf elsewhere), built once per forward -> o_proj, residual, post-norm, MLP, residual. Then the final norm
and the LM head (on every new position, or on each row's last one).

Norms: the RMSNorm modules' own weight and epsilon through one fused `F.rms_norm` (which
normalises in float32 whatever its input's dtype and returns that dtype: HF's cast), then HF's
weight product (fused_norms=True; False calls the modules). HF's version is seven elementwise
kernels, sixty-one times a forward at 30 layers: in a graph of tiny kernels their count, not
their bytes, sets c_S.

GQA without copies: the G = heads / kv_heads query heads that share one kv head are folded
into the query-length axis (q: [B, kv_heads, G*K, D]), so SDPA sees equal head counts and
may use its fused masked kernels; no repeat_kv copy of the stored keys, and no
`enable_gqa` (which falls back to the math kernel when a mask is given). The mask is
additive in the model's dtype, not boolean: on CUDA that lets SDPA pick its memory-efficient
kernel (cutlass, attn_bias), where a bool mask is first converted in every call; flash
attention takes no mask at all, and per-row lengths need one (test_static_cuda checks
that the efficient kernel runs).

Fused projections (fuse_projections=True; the factory sets it for M_S): in a captured step of
a small model every kernel costs ~2.5 us whatever its size, so the q, k and v projections run
as one GEMM over their weights concatenated (a copy made at load, with their biases), gate
and up as another, and the rotary embedding turns q and k in one pass: HF's formula, q *
cos + rotate_half(q) * sin, over the q and k heads side by side, with rotate_half's negation
folded into sin once a forward (the same products, bit for bit). 28 dispatched ops a layer
become 19 (in bf16 32, with the norms' former casts:
tests/backoff_core/runners/test_static_forward.py counts them). The copies cost memory (0.13
GiB for the 135M model, plan.json's fused_gib), which is why M_L, bound by its weights'
bandwidth and not by its kernel count, keeps the modules.

Every shape and Python value here is fixed by the `Batch` key (rows, k, L, dense,
last_only, hidden_layer), and nothing reads a device value back to the host, so a CUDA
graph can capture it (cuda_graphs.py).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backoff_core.runners.static_compiled import ATTENTION, CompiledLayers, project_fused
from backoff_core.runners.static_kv import StaticKV
from backoff_core.runners.static_ragged import RaggedBatch, attention_fn, block_mask, ragged_attention

log = logging.getLogger(__name__)

# Model types whose forward is LlamaModel's: embeddings unscaled, pre-norm blocks, one
# rotary embedding, plain causal attention. Others with the same module names (Gemma
# scales its embeddings, Qwen3 has q_norm/k_norm) compute something else.
SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
_LAYER_MODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
_EXTRA_LAYER_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm", "q_norm", "k_norm")


def check_supported(model, max_len: int) -> None:
    """Raise ValueError (naming the architecture) unless the static forward computes
    exactly what this model's own forward does; callers then fall back to ModelRunner."""
    config = model.config
    what = f"{type(model).__name__} (model_type={getattr(config, 'model_type', None)!r})"
    if getattr(config, "model_type", None) not in SUPPORTED_TYPES:
        raise ValueError(f"the static runner supports {SUPPORTED_TYPES}, not {what}")
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, m) for m in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise ValueError(f"{what}: no model.embed_tokens/layers/norm/rotary_emb")
    if not hasattr(model, "lm_head"):
        raise ValueError(f"{what}: no lm_head")
    for layer in base.layers:
        attn = getattr(layer, "self_attn", None)
        if not all(hasattr(layer, m) for m in _LAYER_MODULES) or not all(hasattr(attn, m) for m in _ATTN_MODULES):
            raise ValueError(f"{what}: a decoder layer lacks the Llama modules {_LAYER_MODULES}")
        if any(hasattr(layer, m) or hasattr(attn, m) for m in _EXTRA_LAYER_NORMS):
            raise ValueError(f"{what}: extra norms in the decoder layer (q_norm/k_norm or sandwich norms)")
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        raise ValueError(f"{what}: layers with sliding-window attention ({set(config.layer_types)})")
    window = getattr(config, "sliding_window", None)
    if window is not None and window < max_len:  # a window that never binds changes nothing
        raise ValueError(f"{what}: sliding window {window} < max_len {max_len}")
    rope_type = getattr(base.rotary_emb, "rope_type", "default")
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
        # these recompute inv_freq from the batch's largest position: no fixed graph
        raise ValueError(f"{what}: rope type {rope_type!r} changes with the sequence length")


@dataclass(frozen=True)
class Batch:
    """One forward's inputs, on the model's device. Row r of the batch is slot slots[r];
    right-padded tokens (and idle rows) sit at position scratch."""

    input_ids: torch.Tensor  # [B, K] long
    positions: torch.Tensor  # [B, K] long: rope position and KV column of each new token
    slots: torch.Tensor  # [B] long: the storage row of each batch row (dense: arange(B))
    last_col: torch.Tensor  # [B] long: column of each row's last real token (last_only)
    length: int  # L: keys [0, L) are read (a bucket >= every row's new length)
    dense: bool  # read storage[:B] as a view (slots == arange(B)) instead of gathering rows
    last_only: bool
    hidden_layer: int | None  # in 0..num_layers (HF hidden_states index), or None
    # [B, C] long: the columns whose logits are computed (scored rows; eager only, never in a
    # graph key); None: every column, or each row's last with last_only
    keep: torch.Tensor | None = None


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's projections concatenated (copies of the modules' weights)."""

    qkv: torch.Tensor  # [(H + 2 kvh) D, d]: q_proj, k_proj, v_proj weights
    qkv_bias: torch.Tensor | None  # their biases (Qwen2, attention_bias), or None
    gate_up: torch.Tensor  # [2 I, d]: gate_proj, up_proj weights
    gate_up_bias: torch.Tensor | None  # mlp_bias, or None

    @staticmethod
    def of_kind(layer) -> bool:
        """Whether the layer's projections are plain Llama Linear modules that can be fused."""
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(mlp, m) for m in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return False
        groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj))
        if not all(isinstance(m, torch.nn.Linear) for group in groups for m in group):
            return False
        return all(len({m.bias is None for m in group}) == 1 for group in groups)  # all or none biased

    @classmethod
    @torch.no_grad()
    def of(cls, layer) -> FusedLayer | None:
        """None where the layer is not plain Llama projections (then it keeps its modules)."""
        if not cls.of_kind(layer):
            return None
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        gate_up = (mlp.gate_proj, mlp.up_proj)

        def cat(modules, name):
            return None if getattr(modules[0], name) is None else torch.cat([getattr(m, name) for m in modules])

        return cls(cat(qkv, "weight"), cat(qkv, "bias"), cat(gate_up, "weight"), cat(gate_up, "bias"))

    @classmethod
    @torch.no_grad()
    def shared(cls, layer) -> FusedLayer | None:
        """`of`, then the modules' own weights (and biases) rebound as views of the fused
        buffers: one copy of the weights, not two (an 8B model's copies would be 9 GiB)."""
        fused = cls.of(layer)
        if fused is None:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        for modules, weight, bias in (
            ((attn.q_proj, attn.k_proj, attn.v_proj), fused.qkv, fused.qkv_bias),
            ((mlp.gate_proj, mlp.up_proj), fused.gate_up, fused.gate_up_bias),
        ):
            start = 0
            for m in modules:
                rows = m.weight.shape[0]
                m.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=False)
                if bias is not None:
                    m.bias = torch.nn.Parameter(bias[start : start + rows], requires_grad=False)
                start += rows
        return fused

    def shares(self, layer) -> bool:
        """Whether the layer's q_proj weight is a view of this fused buffer (no copy held)."""
        return layer.self_attn.q_proj.weight.untyped_storage().data_ptr() == self.qkv.untyped_storage().data_ptr()


def compile_refusal(model, fused_norms: bool) -> str | None:
    """Why the layers of this model cannot run as static_compiled.decoder_layer, or None."""
    if not fused_norms:
        return "its norms are not HF's Llama RMSNorm"
    if getattr(model.config, "hidden_act", None) != "silu":
        return f"activation {getattr(model.config, 'hidden_act', None)!r}, not silu"
    for layer in model.model.layers:
        if not FusedLayer.of_kind(layer) or not all(
            isinstance(m, torch.nn.Linear) for m in (layer.self_attn.o_proj, layer.mlp.down_proj)
        ):
            return (
                "its projections are not plain Linear modules (fp8 weights: docs/fp8.md; or the CPU's oneDNN "
                "kernels wrap them: --cpu-kernels default)"
            )
        if layer.input_layernorm.variance_epsilon != layer.post_attention_layernorm.variance_epsilon:
            return "its two norms of a layer differ in eps"
    return None


def _is_llama_rms_norm(norm) -> bool:
    """HF's Llama-family RMSNorm: a weight, variance_epsilon, and nothing else to compute."""
    return type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon") and hasattr(norm, "weight")


class StaticForward:
    """model + its StaticKV: `__call__(batch) -> (logits [B, K or 1 or C, V], hidden [B, K, d] | None)`."""

    def __init__(
        self,
        model,
        kv: StaticKV,
        fused_norms: bool = True,
        fuse_projections: bool = False,
        compiled: bool = False,
        attention: str = ATTENTION,
    ) -> None:
        check_supported(model, kv.max_len)
        base = model.model
        norms = [base.norm] + [
            n for layer in base.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        self.fused_norms = fused_norms and all(_is_llama_rms_norm(n) for n in norms)
        self.model = model
        self.kv = kv
        self.num_layers = len(model.model.layers)
        attn = model.model.layers[0].self_attn
        self.heads = int(model.config.num_attention_heads)
        self.groups = self.heads // kv.kv_heads  # G query heads per kv head
        # HF's own rope function from the attention's module (each model file has its copy)
        self.rope = inspect.getmodule(type(attn)).apply_rotary_pos_emb
        self.key_index = torch.arange(kv.max_len, device=kv.keys[0].device)  # [M]
        why = compile_refusal(model, self.fused_norms) if compiled else None
        if why is not None:
            log.warning("%s: layers not compiled (%s); the eager static forward runs", kv.name, why)
        self.compiled = CompiledLayers(kv.name, attention) if compiled and why is None else None
        # compiled: q/k/v and gate/up fused for every model, as views of one buffer (no copy)
        fuse = FusedLayer.of if self.compiled is None else FusedLayer.shared
        fused = [fuse(layer) for layer in base.layers] if fuse_projections or self.compiled is not None else []
        self.fused: list[FusedLayer] | None = fused if fused and all(f is not None for f in fused) else None
        self._flex = None  # the ragged forward's attention (static_ragged.attention_fn), at its first use

    def fused_nbytes(self) -> int:
        """Bytes the fused projections' copies hold (0 without them)."""
        if self.compiled is not None:
            return 0  # the modules' weights are views of the fused buffers (FusedLayer.shared)
        tensors = [t for f in self.fused or () for t in (f.qkv, f.qkv_bias, f.gate_up, f.gate_up_bias)]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __call__(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        base = self.model.model
        rows, k = b.input_ids.shape
        h = base.embed_tokens(b.input_ids)  # [B, K, d]
        cos, sin = self._rope_tables(h, b.positions)  # [B, K, D] each
        mask = self.mask(b.positions, b.length, h.dtype)  # [B, 1, G*K, L], shared by every layer
        hidden = h if b.hidden_layer == 0 else None
        if self.compiled is not None:
            h, hidden = self._compiled_layers(h, cos, sin, mask, b, hidden)
        else:
            for i, layer in enumerate(base.layers):
                h = h + self._attention(i, layer.self_attn, self.norm(layer.input_layernorm, h), cos, sin, mask, b)
                h = h + self._mlp(i, layer.mlp, self.norm(layer.post_attention_layernorm, h))
                if b.hidden_layer == i + 1 and i + 1 < self.num_layers:
                    hidden = h
        h = self.norm(base.norm, h)
        if b.hidden_layer == self.num_layers:  # HF ties hidden_states[-1] to the normed output
            hidden = h
        if b.keep is not None:
            h = h[torch.arange(rows, device=h.device)[:, None], b.keep]  # [B, C, d]
        elif b.last_only:
            h = h[torch.arange(rows, device=h.device), b.last_col][:, None]  # [B, 1, d]
        return self.model.lm_head(h), hidden

    def _compiled_layers(self, h, cos, sin, mask, b: Batch, hidden):
        """Every decoder layer through the compiled `decoder_layer` (static_compiled.py): h [B, K, d]
        -> the residual stream after the last layer, and the hidden layer b asks for."""
        delta = torch.zeros_like(h)  # the MLP output each layer adds at its start
        mask = mask.contiguous()  # its G rows are an expand at k = 1: compiled code would copy it in every layer
        with self.compiled.settings():
            for i, layer in enumerate(self.model.model.layers):
                h, delta = self.compiled(h, delta, self.kv.storage[i], b.slots, b.positions, mask, cos, sin,
                    *self._layer_weights(i, layer), dense=b.dense)  # fmt: skip
                if b.hidden_layer == i + 1 and i + 1 < self.num_layers:
                    hidden = h + delta
        return h + delta, hidden

    def _layer_weights(self, i: int, layer) -> tuple:
        """decoder_layer's weight arguments, eps, heads and scaling for layer i."""
        attn, mlp, f = layer.self_attn, layer.mlp, self.fused[i]
        return (
            layer.input_layernorm.weight,
            f.qkv,
            f.qkv_bias,
            attn.o_proj.weight,
            attn.o_proj.bias,
            layer.post_attention_layernorm.weight,
            f.gate_up,
            f.gate_up_bias,
            mlp.down_proj.weight,
            mlp.down_proj.bias,
            layer.input_layernorm.variance_epsilon,
            self.heads,
            attn.scaling,
        )

    def attention(self):
        """The ragged forward's attention (static_ragged.attention_fn), made at its first use."""
        if self._flex is None:
            self._flex = attention_fn(self.kv.keys[0].device)
        return self._flex

    def ragged(self, b: RaggedBatch) -> torch.Tensor:
        """A ragged extend (static_ragged.py): its T tokens as one sequence, each attending over
        its own slot; returns the logits after each item's last token, [R, V]."""
        base = self.model.model
        h = base.embed_tokens(b.input_ids[None])  # [1, T, d]
        cos, sin = self._rope_tables(h, b.positions[None])  # [1, T, D] each
        mask = block_mask(b, self.kv.slots, self.kv.kv_heads, self.groups, self.kv.max_len)  # shared by every layer
        flex = self.attention()
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            q, key, value = self._project(i, attn, self.norm(layer.input_layernorm, h), cos, sin)  # [1, T, heads, D]
            keys, values = self.kv.keys[i], self.kv.values[i]  # [S, kvh, M, D]
            keys[b.slots, :, b.positions] = key[0]  # in place at [slot, :, position]: [T, kvh, D]
            values[b.slots, :, b.positions] = value[0]
            h = h + attn.o_proj(ragged_attention(flex, q[0], keys, values, mask, attn.scaling))[None]
            h = h + self._mlp(i, layer.mlp, self.norm(layer.post_attention_layernorm, h))
        return self.model.lm_head(self.norm(base.norm, h[0, b.last]))  # the norm is per token: [R, d]

    def _rope_tables(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, K, D] at positions [B, K]; with fused projections, rotate_half's
        negation folded into sin once a forward."""
        cos, sin = self.model.model.rotary_emb(h, positions)
        if self.fused is not None:
            half = sin.shape[-1] // 2
            sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos, sin

    def norm(self, module, x: torch.Tensor) -> torch.Tensor:
        """module(x) for an HF Llama RMSNorm: float32 normalisation, cast back, times weight."""
        if not self.fused_norms:
            return module(x)
        # in x's dtype: the kernel normalises in float32 and casts its output, so in bf16 the
        # two casts around it (two kernels a norm) go, with HF's numbers (test_static_forward)
        normed = F.rms_norm(x, (x.shape[-1],), eps=module.variance_epsilon)
        return module.weight * normed

    def mask(self, positions: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        """positions [B, K] -> additive mask [B, 1, G*K, L] (0 visible, -inf hidden), query
        rows ordered (g, k) to match the folded q. Every query sees key 0 at least, so no row
        is all -inf (no NaN)."""
        rows, k = positions.shape
        hidden = self.key_index[None, None, :length] > positions[:, :, None]  # [B, K, L]
        bias = torch.zeros(hidden.shape, dtype=dtype, device=positions.device).masked_fill(hidden, float("-inf"))
        return bias[:, None].expand(rows, self.groups, k, length).reshape(rows, 1, self.groups * k, length)

    def _mlp(self, i: int, mlp, x: torch.Tensor) -> torch.Tensor:
        if self.fused is None:
            return mlp(x)
        gate, up = F.linear(x, self.fused[i].gate_up, self.fused[i].gate_up_bias).chunk(2, dim=-1)  # views
        return mlp.down_proj(mlp.act_fn(gate) * up)  # LlamaMLP.forward's own expression

    def _attention(self, i: int, attn, x: torch.Tensor, cos, sin, mask, b: Batch) -> torch.Tensor:
        rows, k, _ = x.shape
        kvh, g, d = self.kv.kv_heads, self.groups, self.kv.head_dim
        q, key, value = self._project(i, attn, x, cos, sin)
        keys, values = self.kv.keys[i], self.kv.values[i]  # [S, kvh, M, D]
        # in place at [slot, :, position]: the indexed result is [B, K, kvh, D]
        keys[b.slots[:, None], :, b.positions] = key
        values[b.slots[:, None], :, b.positions] = value
        if b.dense:
            keys, values = keys[:rows, :, : b.length], values[:rows, :, : b.length]  # views
        else:
            keys, values = keys[b.slots, :, : b.length], values[b.slots, :, : b.length]  # [B, kvh, L, D] copies
        # fold the G query heads of each kv head into the query axis: [B, kvh, G*K, D]
        q = q.view(rows, k, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(rows, kvh, g * k, d)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
        out = out.view(rows, kvh, g, k, d).permute(0, 3, 1, 2, 4).reshape(rows, k, self.heads * d)
        return attn.o_proj(out)

    def _project(self, i: int, attn, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, K, d] -> q [B, K, H, D], key and value [B, K, kvh, D], rope applied."""
        rows, k, _ = x.shape
        kvh, d = self.kv.kv_heads, self.kv.head_dim
        if self.fused is None:
            q = attn.q_proj(x).view(rows, k, self.heads, d)
            key = attn.k_proj(x).view(rows, k, kvh, d)
            value = attn.v_proj(x).view(rows, k, kvh, d)
            q, key = self.rope(q, key, cos, sin, unsqueeze_dim=2)  # [B, K, H, D] layout
            return q, key, value
        return project_fused(x, self.fused[i].qkv, self.fused[i].qkv_bias, cos, sin, self.heads, kvh, d)
