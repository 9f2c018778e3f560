"""Which runner holds a model: per-session caches, or static KV slots with CUDA graphs."""

from __future__ import annotations

import logging

from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_compiled import resolve as resolve_compile
from backoff_core.runners.static_forward import check_supported
from backoff_core.runners.static_ragged import check_ragged
from backoff_core.types import KVSpec, PrefixCacheSpec

log = logging.getLogger(__name__)


def make_runner(
    model,
    name: str,
    kv: KVSpec | None,
    small: bool = False,
    classifier_path=None,
    prefix_cache: PrefixCacheSpec | None = PrefixCacheSpec(),
) -> ModelRunner | StaticRunner:
    """A ModelRunner, or with `kv` a StaticRunner (static KV slots, CUDA graphs captured
    now, with a progress line) where the architecture allows; other models fall back to
    per-session caches, with a warning. small: M_S extends one token a step (its per-session
    caches and slots never evict: the step loop cannot rebuild an M_S session; static: graphs
    for k = 1 and 2 (a fully accepted draft feeds its last draft and the bonus token), last row
    only, and the hidden layer a classifier head reads; fused q/k/v and gate/up projections).
    Larger models evict idle sessions LRU when a new one needs room (per-session budget or
    slots).
    prefix_cache: the runner's prefix cache (prefix_cache.py; on by default, None: off)."""
    if kv is None or not kv.static:  # per-session caches, within the budget where one is given
        return ModelRunner(
            model, name, None if kv is None else kv.budget_tokens, evict_idle=not small, prefix_cache=prefix_cache
        )
    try:
        check_supported(model, kv.max_len)
    except ValueError as exc:
        log.warning("%s: no static KV storage (%s); per-session caches instead", name, exc)
        return ModelRunner(model, name, kv.budget_tokens, evict_idle=not small, prefix_cache=prefix_cache)
    runner = StaticRunner(
        model,
        name,
        kv_budget_tokens=kv.budget_tokens,
        max_len=kv.max_len,
        cuda_graphs=kv.cuda_graphs,
        evict_idle=not small,  # M_L: evict idle sessions LRU for a new one (re-prefilled later)
        prefix_cache=prefix_cache,
        fuse_projections=small,  # M_S's step is bound by its kernel count (static_forward.py)
        ragged=_ragged(kv, model, name, small),
        ragged_if_faster=kv.ragged == "auto",
        compile_layers=resolve_compile(kv.compile, next(model.parameters()).device, kv.cuda_graphs),
    )
    if small:
        from backoff_core.routing.head import ClassifierHead

        layers = (None,) if classifier_path is None else (None, ClassifierHead.load(classifier_path).layer)
        runner.warmup(hidden_layers=layers, last_only=(True,), ks=(1, 2))
    else:
        runner.warmup()
    return runner


def _ragged(kv: KVSpec, model, name: str, small: bool) -> bool:
    """A larger model's catch-ups as ragged forwards (static_ragged.py) on CUDA: "on", or "auto"
    with CUDA graphs (whose measured replays choose, per catch-up, ragged or padded) and a
    max_len of whole FlexAttention blocks. On another device FlexAttention would run eagerly,
    materialising every score: padded there ("on" warns)."""
    if kv.ragged == "off" or small:
        return False
    device = next(model.parameters()).device
    if device.type != "cuda":
        if kv.ragged == "on":
            log.warning("%s: ragged catch-ups need CUDA (FlexAttention compiled); padded on %s", name, device)
        return False
    if kv.ragged == "on":
        return True  # StaticRunner refuses a max_len FlexAttention's blocks do not fill, naming it
    try:
        check_ragged(kv.max_len, device)
    except ValueError as exc:
        log.info("%s: ragged catch-ups off (%s)", name, exc)
        return False
    return kv.cuda_graphs
