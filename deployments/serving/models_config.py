"""The models a Serve application loads and how each replica holds their KV: `ModelsConfig`,
part of the builder's `args` (changing it redeploys the replicas). No Ray and no torch here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backoff_core.types import KVSpec, PrefixCacheSpec

DEFAULT_LARGE = "SmolLM2-135M-Instruct"  # the embedded default pair's M_L (backoff_core.models.default_pair)


class FrozenConfig(BaseModel):
    """Every config model's base: unknown fields refused, values fixed once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorParallel(FrozenConfig):
    """Ranks per model (backoff_core/parallel, docs/tensor-parallel.md): a model over N > 1 is
    split Megatron-style over N ranks: its replica (rank 0) and N - 1 Ray actors, in a
    placement group of N bundles of its ray_actor_options (GPUs and CPUs) on one node."""

    small: int = Field(1, ge=1, description="M_S's ranks (the SmallModel replica)")
    large: int = Field(1, ge=1, description="M_L's ranks (each LargeModel replica)")
    medium: list[int] = Field(
        default_factory=list, description="each medium model's ranks, smallest first (1 if unlisted)"
    )

    def size(self, level: int, num_levels: int) -> int:
        """The ranks of the model at `level` (0 = M_S) of a chain of `num_levels`."""
        if level == 0:
            return self.small
        if level == num_levels - 1:
            return self.large
        return self.medium[level - 1] if level - 1 < len(self.medium) else 1


Quantize = Literal["none", "fp8"]  # backoff_core.models.fp8.QUANTIZE_MODES


class Quantization(FrozenConfig):
    """Weights per model (docs/fp8.md): fp8 = the decoder's linear layers in e4m3 with 128 x 128
    block scales (W8A8 on GPUs with fp8 tensor cores, weight-only elsewhere); none = the
    model's dtype. A checkpoint stored in fp8 (compressed-tensors) loads as stored either way."""

    small: Quantize = Field("none", description="M_S's weights: none or fp8")
    large: Quantize = Field("none", description="M_L's weights: none or fp8 (a medium model keeps its dtype)")


class ModelsConfig(FrozenConfig):
    small: str | None = Field(
        None,
        description="M_S: local dir, cached HF id or .gguf file; none (with large none) = the embedded default pair",
    )
    large: str | None = Field(None, description="M_L: local dir, cached HF id or .gguf file")
    medium: list[str] = Field(
        default_factory=list,
        description="intermediate models, smallest first; each deploys as one more LargeModel-like actor",
    )
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto (cuda where the replica has a GPU)")
    dtype: str = Field("float32", description="float32, bfloat16 or float16")
    cpu_kernels: Literal["mkldnn", "default"] = Field(
        "mkldnn", description="linear layers of float32 models on CPU: oneDNN (faster) or torch's default"
    )
    quantize: Quantization = Field(
        default_factory=Quantization,
        description="weights per model, e.g. {large: fp8}; one value (fp8) sets both models (docs/fp8.md)",
    )
    classifier: str | None = Field(None, description="router head directory for the classifier router")
    served_name: str = Field("backoff", description="model name that GET /v1/models reports")
    kv_budget_tokens: int | Literal["auto"] = Field(
        "auto",
        description="KV positions each model replica may hold across its sessions (backoff_core/runners/kv_budget.py). "
        "auto: resolved at replica start, 80% of the GPU memory free after the weights (times "
        "the replica's GPU share), or 20% of the RAM available on a CPU; the replica logs it and "
        "info() / the kv metrics report it. Full: idle sessions are evicted LRU (re-prefilled "
        "at their next catch-up); new requests get 503 + Retry-After while live ones fill it",
    )
    static_kv: Literal["auto"] | bool = Field(
        "auto",
        description="how the budget is stored: true = preallocated slots of kv_max_len (CUDA graphs on a "
        "GPU), false = per-session caches that count what they hold, auto = slots on CUDA, "
        "per-session caches on the CPU",
    )
    kv_max_len: int = Field(2048, ge=2, description="static KV: positions per slot (prompt + output of one request)")
    cuda_graphs: bool = Field(
        True, description="static KV on a GPU: replay captured CUDA graphs for steps and short catch-ups"
    )
    ragged_catch_ups: Literal["auto", "on", "off"] = Field(
        "auto",
        description="static KV on a GPU: the large model's catch-ups as ragged forwards, their tokens unpadded "
        "(FlexAttention over the slots; docs/gpu.md): auto = with CUDA graphs, each catch-up ragged where its "
        "replays were timed faster than its padded layout's; on = wherever they apply; off. true/false read as "
        "on/off. Ignored on the CPU",
    )
    compile_layers: Literal["auto", "on", "off"] = Field(
        "auto",
        description="static KV: every decoder layer one inductor-compiled function, fewer and larger kernels "
        "a step (docs/gpu.md): auto = where CUDA graphs capture it (compiled at load, cached on disk by "
        "inductor), on = also eagerly (the CPU compiles C++), off",
    )
    prefix_cache_tokens: int = Field(
        8192,
        ge=0,
        description="prefix cache of every model replica (backoff_core/runners/prefix_cache.py): KV positions of "
        "prompt blocks seen before that it keeps, LRU; a request starts from its longest cached prefix. 0: off",
    )
    prefix_block_tokens: int = Field(32, ge=1, description="prefix cache: prompt tokens per cached block")
    tensor_parallel: TensorParallel = Field(
        default_factory=TensorParallel,
        description="ranks per model, e.g. {large: 4}: the model split over that many GPUs of one node (or CPU "
        "processes); the size must divide its heads and MLP width and divide its KV heads or be a multiple of them",
    )

    def kv_spec(self, model, gpu_share: float = 1.0) -> KVSpec:
        """The budget and storage a replica of `model` runs with (`auto` resolved on its device)."""
        from backoff_core.runners.kv_budget import resolve_kv  # torch: only where a model is loaded

        return resolve_kv(
            model,
            self.kv_budget_tokens,
            self.kv_max_len,
            self.static_kv,
            self.cuda_graphs,
            gpu_share,
            reserve_tokens=self.prefix_cache_tokens,  # `auto` leaves the prefix cache its room
            ragged=self.ragged_catch_ups,
            compile=self.compile_layers,
        )

    def prefix_spec(self) -> PrefixCacheSpec | None:
        """Every model replica's prefix cache; None: off."""
        if self.prefix_cache_tokens == 0:
            return None
        return PrefixCacheSpec(self.prefix_cache_tokens, self.prefix_block_tokens)

    @field_validator("ragged_catch_ups", mode="before")
    @classmethod
    def _ragged_bool(cls, value):
        """true / false, the spelling before "auto": on / off."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("quantize", mode="before")
    @classmethod
    def _quantize_both(cls, value):
        """quantize: fp8 (one value): both models."""
        return {"small": value, "large": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _both_or_neither(self) -> "ModelsConfig":
        if (self.small is None) != (self.large is None):
            raise ValueError("name both small and large, or neither (the embedded default pair)")
        if self.medium and self.small is None:
            raise ValueError("a chain with medium models needs small and large named too")
        budget = self.kv_budget_tokens
        if budget != "auto" and budget < 1:
            raise ValueError(f"kv_budget_tokens must be >= 1 or 'auto', got {budget}")
        if self.static_kv is True and budget != "auto" and budget < self.kv_max_len:
            raise ValueError(
                f"kv_budget_tokens ({self.kv_budget_tokens}) holds no slot of kv_max_len ({self.kv_max_len}) positions"
            )
        for which in ("small", "large"):
            if getattr(self.quantize, which) == "fp8" and getattr(self.tensor_parallel, which) > 1:
                raise ValueError(
                    f"quantize.{which}: fp8 over tensor-parallel ranks is not built yet; use one or the other"
                )
        return self

    @property
    def num_levels(self) -> int:
        return 2 + len(self.medium)

    @property
    def root(self) -> str:
        """What the served name stands for (GET /v1/models' `root`, as vLLM's): M_L's path or id."""
        return self.large or DEFAULT_LARGE
