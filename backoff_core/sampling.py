"""Turning logits into the distribution a token is drawn from, and drawing it.

Every model's logits go through the same `distribution()` so that the small and large
distributions compared by a decision function or a verification are the ones tokens are
actually sampled from. Greedy decoding is a one-hot distribution on the argmax, which makes
exact rejection sampling reduce to "accept iff the large model's argmax agrees".
"""

from __future__ import annotations

import torch

from .types import SamplingParams


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] -> probabilities [..., V] after temperature, top-k and top-p."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """probs: [V] -> one token id. The generator lives on the CPU so seeds agree across devices."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator).item())


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) over the last dim, from raw logits ([..., V] -> [...]); temperature 1."""
    log_p = torch.log_softmax(p_logits.float(), dim=-1)
    log_q = torch.log_softmax(q_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def residual(p_large: torch.Tensor, p_small: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p_L - p_S)): what speculative sampling draws from after a rejection."""
    r = (p_large - p_small).clamp_min(0.0)
    total = r.sum()
    return r / total if total > 0 else p_large
