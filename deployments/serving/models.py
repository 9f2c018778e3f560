"""Loading one level of the chain inside a replica (each replica loads only its model).

The SmallModel needs M_S, the shared tokenizer and the chain's context window; a
LargeModel replica needs its own model. No models named = the embedded default pair, whose
M_S shares M_L's embeddings, so the SmallModel loads M_L's file for them (its decoder
layers are dropped with the reference). No Ray here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel

from backoff_core.models.kernels import use_cpu_kernels
from backoff_core.models.loading import LoadSpec, check_same_tokenizer, load_model

from deployments.serving.config import ModelsConfig


@dataclass(frozen=True)
class SmallSide:
    model: PreTrainedModel
    tokenizer: object
    context_window: int | None
    hidden_size: int


def _spec(cfg: ModelsConfig) -> LoadSpec:
    return LoadSpec(device=cfg.device, dtype=cfg.dtype, cpu_kernels=cfg.cpu_kernels)


def _where(name: str) -> tuple[str, dict]:
    path = Path(name)
    if path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return name, ({} if path.exists() else {"local_files_only": True})


def chain_names(cfg: ModelsConfig) -> list[str | None]:
    """Model names smallest first (None for the default pair's two levels)."""
    if cfg.small is None:
        return [None, None]
    return [cfg.small, *cfg.medium, cfg.large]


def load_small_side(cfg: ModelsConfig, threads: int | None = None) -> SmallSide:
    if threads:
        torch.set_num_threads(threads)
    if cfg.small is None:
        from backoff_core.models.default_pair import load_default_pair

        spec = _spec(cfg)
        small, _, tokenizer = load_default_pair(device=spec.torch_device(), dtype=spec.torch_dtype())
        small = use_cpu_kernels(small, spec.cpu_kernels)
        window = getattr(small.config, "max_position_embeddings", None)
        return SmallSide(small, tokenizer, window, small.config.hidden_size)
    model, tokenizer = load_model(cfg.small, _spec(cfg))
    others = [n for n in chain_names(cfg)[1:]]
    tokenizers = [AutoTokenizer.from_pretrained(w, **x) for w, x in map(_where, others)]
    check_same_tokenizer([cfg.small, *others], [tokenizer, *tokenizers])
    windows = [getattr(model.config, "max_position_embeddings", None)]
    windows += [getattr(AutoConfig.from_pretrained(w, **x), "max_position_embeddings", None) for w, x in map(_where, others)]
    windows = [w for w in windows if w]
    return SmallSide(model, tokenizer, min(windows) if windows else None, model.config.hidden_size)


def load_level(cfg: ModelsConfig, level: int, threads: int | None = None) -> PreTrainedModel:
    """The model at `level` (1 .. num_levels-1) of the chain."""
    if threads:
        torch.set_num_threads(threads)
    name = chain_names(cfg)[level]
    if name is None:
        from backoff_core.models.default_pair import load_default_large

        spec = _spec(cfg)
        large = load_default_large(device=spec.torch_device(), dtype=spec.torch_dtype())[0]
        return use_cpu_kernels(large, spec.cpu_kernels)
    return load_model(name, _spec(cfg))[0]
