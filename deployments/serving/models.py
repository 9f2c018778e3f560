"""Loading one level of the chain inside a replica (each replica loads only its model):
the ModelsConfig read into backoff_core.models.loading's calls. No Ray here."""

from __future__ import annotations

import dataclasses

import torch
from transformers import PreTrainedModel

from backoff_core.models import loading
from backoff_core.models.loading import LoadSpec, SmallSide
from deployments.serving.models_config import ModelsConfig


def _names(cfg: ModelsConfig) -> tuple[str, ...] | None:
    return loading.chain_names(cfg.small, cfg.large, cfg.medium)


def _spec(cfg: ModelsConfig) -> LoadSpec:
    return LoadSpec(
        device=cfg.device,
        dtype=cfg.dtype,
        cpu_kernels=cfg.cpu_kernels,
        quantize_small=cfg.quantize.small,
        quantize_large=cfg.quantize.large,
    )


def _use_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def load_small_side(cfg: ModelsConfig, threads: int | None = None) -> SmallSide:
    _use_threads(threads)
    return loading.load_small_side(_names(cfg), _spec(cfg))


def load_level(cfg: ModelsConfig, level: int, threads: int | None = None, host: bool = False) -> PreTrainedModel:
    """The model at `level` (1 .. num_levels-1) of the chain. host: on the CPU whatever the
    config's device (a model split over tensor-parallel ranks is split from there)."""
    _use_threads(threads)
    spec = _spec(cfg)
    return loading.load_level(_names(cfg), level, dataclasses.replace(spec, device="cpu") if host else spec)


def rank_device(cfg: ModelsConfig) -> str:
    """Where a model's tensor-parallel ranks run: the config's device resolved ("cuda", "cpu")."""
    return _spec(cfg).torch_device().split(":")[0]
