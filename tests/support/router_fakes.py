"""Synthetic router data: KL is (or is not) a function of the hidden state, so a head can
be checked to learn it (and to fail when there is nothing to learn)."""

from __future__ import annotations

import pytest
import torch

from backoff_core.learning.data import RouterData


def synthetic(n: int = 4000, d: int = 16, seed: int = 0, signal: bool = True, layers=(0, 1)) -> RouterData:
    g = torch.Generator().manual_seed(seed)
    hidden = {layer: torch.randn(n, d, generator=g) for layer in layers}
    w = torch.randn(d, generator=g) / d**0.5
    h = hidden[max(layers)]
    log_kl = 1.5 * (h @ w) / (h @ w).std() - 1.0 if signal else torch.randn(n, generator=g) - 1.0
    log_kl = log_kl + 0.2 * torch.randn(n, generator=g)
    kl = log_kl.exp()
    nll_l = 1.0 + torch.rand(n, generator=g)
    nll_s = nll_l + kl * (0.5 + torch.rand(n, generator=g))  # a high-KL step costs M_S more
    window = torch.arange(n, dtype=torch.int32) // 20  # "windows" of 20 positions
    fields = {
        "kl": kl,
        "ent_s": torch.rand(n, generator=g) * 3,
        "ent_l": torch.rand(n, generator=g) * 3,
        "maxp_s": torch.rand(n, generator=g),
        "nll_s": nll_s,
        "nll_l": nll_l,
        "agree": (kl < 0.5).to(torch.uint8),
        "window": window,
        "pos": torch.arange(n, dtype=torch.int32) % 20,
        "domain": (window % 2).int(),
        "token": torch.zeros(n, dtype=torch.int32),
        "doc": window // 2,  # two windows a document
    }
    return RouterData(
        fields,
        {k: v.half() for k, v in hidden.items()},
        ["a", "b"],
        {"names": ["s", "l"], "small_fingerprint": "synthetic"},
    )


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run ~30x slower with 2 threads than 1 when the CPU is shared (OpenMP
    threads wait on each other); the router tests pin 1 thread and restore it after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
