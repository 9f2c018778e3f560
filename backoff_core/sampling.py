"""Turning logits into the distribution a token is drawn from, and drawing it.

Every model's logits go through the same `distributions()` so that the small and large
distributions compared by a decision function or a verification are the ones tokens are
actually sampled from. Greedy decoding is a one-hot distribution on the argmax, which makes
exact rejection sampling reduce to "accept iff the large model's argmax agrees".

Randomness is counter-based, on the logits' own device: the noise of a draw is a hash of
(request seed, position, stream), so a request gives the same tokens batched or alone, on
any device, with no generator state to carry and no host round trip per request: a row's
CDF is inverted at its hashed uniform, all rows in one op. Streams keep the draws
of one position independent: the token itself, the router's coin, the rejection test and
the replacement after a rejection.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Sequence

import torch

from backoff_core.types import SamplingParams

_MASK32 = 0xFFFFFFFF


class Stream(enum.IntEnum):
    """Independent random streams at one position."""

    TOKEN = 0  # the token drawn from the chosen level's distribution
    ROUTER = 1  # the random router's coin
    ACCEPT = 2  # exact rejection sampling's accept test
    REPLACE = 3  # the token that replaces a rejected one


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] -> probabilities [..., V] after temperature, top-k and top-p."""
    flat = logits.reshape(-1, logits.shape[-1])
    return distributions(flat, [params] * flat.shape[0]).reshape(logits.shape)


def distributions(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [B, V], one SamplingParams per row -> probabilities [B, V] (float32).

    Every row is a proper distribution whatever finite parameters it has: a temperature
    under the floor is greedy, top-p always keeps the most likely token, and a row whose
    logits are not finite falls back to its argmax over the finite ones.
    """
    logits = logits.float()
    b, v = logits.shape
    dev = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=dev)  # [B]
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)  # [B]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params], device=dev)  # [B]
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)  # [B]
    logits = torch.nan_to_num(logits, nan=float("-inf"))
    scaled = logits / temperature[:, None]
    if bool((top_k < v).any()) or bool((top_p < 1.0).any()):
        scaled = _truncate(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), v).float()
    bad = ~torch.isfinite(probs).all(-1)  # e.g. every logit -inf
    return torch.where((greedy | bad)[:, None], one_hot, probs)


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) what top-k and top-p drop; scaled: [B, V] sorted once for both."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None]  # [1, V]
    drop_sorted = rank >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop_sorted, float("-inf")), dim=-1).double()
    # top-p: keep the smallest prefix whose mass reaches top_p; the top token always stays
    drop_sorted |= (probs.cumsum(-1) - probs) >= top_p[:, None]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))


# -- counter-based randomness --------------------------------------------------------------
def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in [0, 2^32).
    Products wrap in int64; masking keeps their low 32 bits, which is all the hash uses."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _keys(seeds: Sequence[int], positions: Sequence[int], stream: Stream, device) -> torch.Tensor:
    """One 32-bit key per row from (seed, position, stream): [B] int64."""
    lo = torch.tensor([s & _MASK32 for s in seeds], dtype=torch.int64, device=device)
    hi = torch.tensor([(s >> 32) & _MASK32 for s in seeds], dtype=torch.int64, device=device)
    pos = torch.tensor([p & _MASK32 for p in positions], dtype=torch.int64, device=device)
    key = _mix(lo ^ _mix(hi ^ _mix(pos ^ _mix(torch.full_like(pos, int(stream) + 0x9E3779B9)))))
    return key


def uniforms(
    seeds: Sequence[int], positions: Sequence[int], stream: Stream, width: int = 1, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """U(0, 1) noise [B, width] (float32, never 0 or 1), a pure function of its arguments."""
    keys = _keys(seeds, positions, stream, device)  # [B]
    index = torch.arange(width, dtype=torch.int64, device=device)[None]  # [1, W]
    bits = _mix(keys[:, None] ^ _mix(index * 0x9E3779B1 & _MASK32))  # [B, W]
    return ((bits >> 8).float() + 0.5) / float(1 << 24)


def sample_rows(
    probs: torch.Tensor, seeds: Sequence[int], positions: Sequence[int], stream: Stream = Stream.TOKEN
) -> torch.Tensor:
    """probs: [B, V] -> token ids [B] (on probs' device), row i drawn by inverting its CDF
    at the uniform of (seeds[i], positions[i], stream): one hash per row, one cumsum."""
    u = uniforms(seeds, positions, stream, 2, probs.device).double()  # [B, 2]: 48 bits of resolution
    u = (u[:, 0] + (u[:, 1] - 0.5 / (1 << 24)) / (1 << 24))[:, None]  # [B, 1] in (0, 1)
    cdf = probs.double().cumsum(-1)  # [B, V]
    # the first token whose CDF reaches u·total: a zero-probability token never does first
    token = torch.searchsorted(cdf, u * cdf[:, -1:], right=False)[:, 0]
    return token.clamp_max(probs.shape[-1] - 1)


def draw(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int]
) -> list[int]:
    """logits: [B, V] -> the token of each row, drawn from its own distribution at its own
    (seed, position): the whole batch in one pass and one host copy."""
    return sample_rows(distributions(logits, params), seeds, positions).tolist()


def sample(probs: torch.Tensor, seed: int, position: int, stream: Stream = Stream.TOKEN) -> int:
    """probs: [V] -> one token id (one host sync)."""
    return int(sample_rows(probs[None], [seed], [position], stream)[0])


def uniform(seed: int, position: int, stream: Stream) -> float:
    return float(uniforms([seed], [position], stream)[0, 0])


def request_seed(seed: int | None) -> int:
    """The seed a request's draws use: its own, or a fresh random one."""
    return secrets.randbits(63) if seed is None else int(seed)


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
