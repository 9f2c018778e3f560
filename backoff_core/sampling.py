"""Turning logits into the distribution a token is drawn from, and drawing it.

Every model's logits go through the same `distributions()` so that the small and large
distributions compared by a decision function or a verification are the ones tokens are
actually sampled from. Greedy decoding is a one-hot distribution on the argmax, which makes
exact rejection sampling reduce to "accept iff the large model's argmax agrees".

Randomness is counter-based: the noise of a draw is a hash of (request seed, position,
stream), so a request gives the same tokens batched or alone, on any device, with no
generator state to carry. The hash runs on the host over host data and reaches the device
in the same upload as the rows' parameters; a row's CDF is inverted at its uniform on the
logits' device, all rows in one op, and nothing here reads the device back (the step loop
does, once per stage: engine/host.py). Streams keep the draws
of one position independent: the token itself, the router's coin, the rejection test and
the replacement after a rejection.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backoff_core.types import SamplingParams

_MASK32 = 0xFFFFFFFF


class Stream(enum.IntEnum):
    """Independent random streams at one position."""

    TOKEN = 0  # the token drawn from the chosen level's distribution
    ROUTER = 1  # the random router's coin
    ACCEPT = 2  # exact rejection sampling's accept test
    REPLACE = 3  # the token that replaces a rejected one


@dataclass(frozen=True)
class Penalties:
    """What presence, frequency and repetition penalties read for the penalized rows of a
    batch, each at its own position (engine/penalties.py builds it from the requests' counts
    on the device): nothing in it is host data that grows with the sequence."""

    rows: torch.Tensor  # [P] long: the penalized rows' indices in the batch
    counts: torch.Tensor  # [P, V] float32: how often each id occurs among the row's generated tokens
    seen: torch.Tensor | None  # [P, V] bool: ids in the row's prompt or generated tokens; None: no row repeats
    repetition: torch.Tensor | None  # [P, 1] float32: each row's repetition penalty (with seen)
    # [P, V] float32: presence x (count > 0) + frequency x count, in float64 rounded once; None: neither
    subtract: torch.Tensor | None
    at: tuple[int, ...]  # the same indices as host data


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] -> probabilities [..., V] after temperature, min-p, top-k and top-p."""
    flat = logits.reshape(-1, logits.shape[-1])
    return distributions(flat, [params] * flat.shape[0]).reshape(logits.shape)


def argmax_last(x: torch.Tensor, nan_lowest: bool = False) -> torch.Tensor:
    """x.argmax(-1) for float32 x [B, V]: the first maximum of each row; a NaN counts as the
    maximum, as in torch, or (nan_lowest) as -inf: the argmax over the other values. On the
    CPU it is numpy's vectorised argmax: torch's CPU argmax over the last dim costs ~10x more
    (2.6 ms against 0.2 ms for [64, 49152] on one thread, more than the rest of a CPU step's
    host work), and with nan_lowest only a row whose argmax is a NaN is cleaned and redone.
    Elsewhere it is torch's own, on the device."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        return (torch.nan_to_num(x, nan=float("-inf")) if nan_lowest else x).argmax(-1)
    if nan_lowest and x.dim() != 2:
        x = torch.nan_to_num(x, nan=float("-inf"))
    a = x.numpy()
    best = a.argmax(-1)
    if nan_lowest and a.ndim == 2:  # numpy's argmax is the first NaN of a row that has one
        nan_rows = np.isnan(a[np.arange(len(best)), best])
        if nan_rows.any():
            best[nan_rows] = np.where(np.isnan(a[nan_rows]), -np.inf, a[nan_rows]).argmax(-1)
    return torch.from_numpy(best.astype(np.int64, copy=False))


class _ByIdentity:
    """A cache of `make(obj, *extra)` keyed by obj's identity, not its hash: hashing params with
    a 300-entry logit_bias for every row of every draw costs what the cache saves. It holds obj,
    so its id is not reused while cached, and forgets everything past `size` entries. A request
    draws with the same params objects at every step, so it misses once."""

    def __init__(self, make: Callable, size: int = 4096) -> None:
        self.make, self.size, self.entries = make, size, {}

    def __call__(self, obj, *extra):
        key = (id(obj), *extra)
        hit = self.entries.get(key)
        if hit is not None and hit[0] is obj:
            return hit[1]
        if len(self.entries) >= self.size:  # dict ops are atomic: a flight's thread may call too
            self.entries.clear()
        value = self.make(obj, *extra)
        self.entries[key] = (obj, value)
        return value


def _make_row(params: SamplingParams, vocab: int) -> tuple[float, float, float, float, float]:
    """One row of a batch's parameter upload: (greedy, temperature, top_k, top_p, min_p)."""
    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    temperature = 1.0 if params.greedy else params.temperature
    return (float(params.greedy), temperature, float(top_k), params.top_p, params.min_p)


_row = _ByIdentity(_make_row)


def distributions(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    noise: Sequence[float] | None = None,
    penalties: Penalties | None = None,
) -> torch.Tensor:
    """logits: [B, V], one SamplingParams per row -> probabilities [B, V] (float32).

    The penalties apply first (repetition, then presence and frequency), then a row's
    logit_bias (greedy: the argmax of the penalized, biased logits).
    Every row is a proper distribution whatever finite parameters it has: a temperature
    under the floor is greedy, top-p always keeps the most likely token, and a row whose
    logits are not finite falls back to its argmax over the finite ones.
    The rows' parameters reach the device in one upload (with `noise`, one more float per
    row that `draw` rides along), and which ops run is decided from them on the host:
    nothing here waits for the device.
    """
    probs, _ = _distributions(logits, params, noise, penalties)
    return probs


def _distributions(logits, params, noise=None, penalties=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (probabilities [B, V] float32, the uploaded noise column [B] float64 or None)."""
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"))  # a copy: the bias adds in place
    b, v = logits.shape
    if penalties is not None:
        _penalize(logits, penalties)
    if any(p.logit_bias for p in params):
        _add_bias(logits, params)
    if any(p.allowed_token_ids for p in params):
        _allow(logits, params)
    # [B, V]; not F.one_hot, which checks its input's range with a host read on a CPU
    one_hot = torch.zeros_like(logits).scatter_(-1, argmax_last(logits)[:, None], 1.0)
    rows = [_row(p, v) for p in params]
    if all(r[0] for r in rows) and noise is None:  # greedy everywhere: nothing to upload
        return one_hot, None
    table = [r + (u,) for r, u in zip(rows, noise)] if noise is not None else rows
    # [B, 5 or 6] float64: greedy, temperature, top_k, top_p, min_p (, noise); exact for every field
    col = torch.tensor(table, dtype=torch.float64).to(logits.device, non_blocking=True)
    greedy = col[:, 0] != 0  # [B]
    scaled = logits / col[:, 1, None].float()  # float32 temperature, as the parameters round it
    if any(r[4] > 0 for r in rows):  # min_p: logit >= the row's max + log(min_p) (log 0 = -inf: none dropped)
        floor = scaled.max(-1, keepdim=True).values + col[:, 4, None].float().log()  # [B, 1]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if any(r[2] < v or r[3] < 1.0 for r in rows):
        scaled = _truncate(scaled, col[:, 2].long(), col[:, 3])
    probs = torch.softmax(scaled, dim=-1)
    bad = ~torch.isfinite(probs).all(-1)  # e.g. every logit -inf
    return torch.where((greedy | bad)[:, None], one_hot, probs), (col[:, 5] if noise is not None else None)


def _penalize(logits: torch.Tensor, pen: Penalties) -> None:
    """logits [B, V], in place, at the penalized rows: HF's repetition penalty (a seen id's
    logit / p where positive, * p elsewhere; 1.0 divides and multiplies exactly), then what
    presence and frequency subtract, as vLLM applies them. Everything was computed and
    uploaded with the Penalties, once for every distribution of the batch."""
    x = logits.index_select(0, pen.rows)  # [P, V]
    if pen.seen is not None:
        x = torch.where(pen.seen, torch.where(x > 0, x / pen.repetition, x * pen.repetition), x)
    if pen.subtract is not None:
        x = x - pen.subtract
    logits.index_copy_(0, pen.rows, x)


def _make_bias_table(bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """A logit_bias as [2, N] float64 (ids < 2^31 are exact in it): made once per request's
    bias, up to 300 entries (the edge's cap), not entry by entry at every draw."""
    return np.array(bias, dtype=np.float64).reshape(-1, 2).T


_bias_table = _ByIdentity(_make_bias_table, size=1024)


def _add_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """logits [B, V] += each row's logit_bias, in place: one upload of [3, N] float64 (row, id,
    bias), built from each distinct bias's cached arrays, not entry by entry."""
    at = [i for i, p in enumerate(params) if p.logit_bias]
    tables = [_bias_table(params[i].logit_bias) for i in at]
    rows = np.repeat(np.array(at, dtype=np.float64), [t.shape[1] for t in tables])
    table = torch.from_numpy(np.vstack([rows, np.hstack(tables)])).to(logits.device, non_blocking=True)
    logits.index_put_((table[0].long(), table[1].long()), table[2].float(), accumulate=True)


_allowed_ids = _ByIdentity(lambda ids: np.asarray(ids, dtype=np.int64), size=1024)


def _allow(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """logits [B, V], in place: at each row with allowed_token_ids, every other id -inf (one
    upload of [2, R + N] int64: the rows, then (row, id) pairs, from each distinct list's
    cached array; no host read)."""
    at = [i for i, p in enumerate(params) if p.allowed_token_ids]
    ids = [_allowed_ids(params[i].allowed_token_ids) for i in at]
    rows = np.repeat(np.array(at, dtype=np.int64), [len(x) for x in ids])
    table = np.vstack([np.concatenate([at, rows]), np.concatenate([np.zeros(len(at), np.int64), *ids])])
    table = torch.from_numpy(table).to(logits.device, non_blocking=True)
    keep = torch.ones_like(logits, dtype=torch.bool)  # [B, V]
    keep[table[0, : len(at)]] = False
    keep[table[0, len(at) :], table[1, len(at) :]] = True
    logits.masked_fill_(~keep, float("-inf"))


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
# The hash runs on the host (numpy, uint32: its multiplications wrap mod 2^32 as the hash
# wants, no masking op): its inputs (seeds, positions) are host data, so a row's noise rides
# to the device in the same upload as its parameters instead of some 40 tiny device ops per draw.
_U32 = np.uint32


# 0-d uint32 operands and a scratch array for the shifts: numpy's per-call overhead, not the
# arithmetic, is the cost at a batch's size (~2 us a mix at 64 rows against ~4.5 with scalars)
_SHIFT15, _SHIFT16 = np.array(15, _U32), np.array(16, _U32)
_MUL1, _MUL2 = np.array(0x7FEB352D, _U32), np.array(0x846CA68B, _U32)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (lowbias32) of a uint32 array, in place (returns x)."""
    shifted = np.empty_like(x)
    x ^= np.right_shift(x, _SHIFT16, out=shifted)
    x *= _MUL1
    x ^= np.right_shift(x, _SHIFT15, out=shifted)
    x *= _MUL2
    x ^= np.right_shift(x, _SHIFT16, out=shifted)
    return x


_STREAM = {s: _mix(np.array([int(s) + 0x9E3779B9], dtype=_U32))[0] for s in Stream}
_INDEX = _mix(np.arange(8, dtype=_U32) * _U32(0x9E3779B1))  # index < 8


def _bits(seeds: Sequence[int], positions: Sequence[int], stream: Stream, width: int) -> np.ndarray:
    """[B, width] uint32 hash values of (seed, position, stream, index); a seed counts mod
    2^64 (its low and high 32 bits), a position mod 2^32."""
    try:  # the usual seeds and positions (in [0, 2^64)): the truncations as array casts
        s = np.array(seeds, dtype=np.uint64)
        key = np.array(positions, dtype=np.uint64).astype(_U32)
        lo, hi = s.astype(_U32), (s >> np.uint64(32)).astype(_U32)
    except OverflowError:  # a negative or huge one: Python's own integers
        lo = np.array([s & _MASK32 for s in seeds], dtype=_U32)
        hi = np.array([(s >> 32) & _MASK32 for s in seeds], dtype=_U32)
        key = np.array([p & _MASK32 for p in positions], dtype=_U32)
    key ^= _STREAM[stream]
    key = _mix(key)
    key ^= hi
    key = _mix(key)
    key ^= lo
    key = _mix(key)  # [B]
    index = _INDEX[:width] if width <= len(_INDEX) else _mix(np.arange(width, dtype=_U32) * _U32(0x9E3779B1))
    return _mix(key[:, None] ^ index[None])


def host_uniforms(seeds: Sequence[int], positions: Sequence[int], stream: Stream, width: int = 1) -> np.ndarray:
    """U(0, 1) noise [B, width] (float32 values, never 0 or 1), a pure function of its arguments."""
    bits = (_bits(seeds, positions, stream, width) >> 8).astype(np.float32)
    return (bits + np.float32(0.5)) / np.float32(1 << 24)


def uniforms(
    seeds: Sequence[int], positions: Sequence[int], stream: Stream, width: int = 1, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """host_uniforms as a tensor [B, width] float32 on `device`."""
    return torch.from_numpy(host_uniforms(seeds, positions, stream, width)).to(device)


def draw_noise(seeds: Sequence[int], positions: Sequence[int], stream: Stream = Stream.TOKEN) -> list[float]:
    """The float64 uniform in (0, 1) that a row's CDF is inverted at: two 24-bit uniforms,
    48 bits of resolution."""
    u = host_uniforms(seeds, positions, stream, 2).astype(np.float64)  # [B, 2]
    return (u[:, 0] + (u[:, 1] - 0.5 / (1 << 24)) / (1 << 24)).tolist()


def _invert(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs: [B, V], u: [B] float64 -> token ids [B]: the first token whose CDF reaches
    u·total (a zero-probability token never does first)."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    token = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=False)[:, 0]
    return token.clamp_max(probs.shape[-1] - 1)


def sample_rows(
    probs: torch.Tensor, seeds: Sequence[int], positions: Sequence[int], stream: Stream = Stream.TOKEN
) -> torch.Tensor:
    """probs: [B, V] -> token ids [B] (on probs' device), row i drawn by inverting its CDF
    at the uniform of (seeds[i], positions[i], stream): one hash per row, one cumsum."""
    u = torch.tensor(draw_noise(seeds, positions, stream), dtype=torch.float64).to(probs.device)
    return _invert(probs, u)


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
    stream: Stream = Stream.TOKEN,
    penalties: Penalties | None = None,
) -> torch.Tensor:
    """logits: [B, V] -> the token of each row [B] (on the logits' device, not read back:
    the caller reads it with the rest of its stage, engine/host.py), drawn from its own
    distribution at its own (seed, position). One upload (parameters and noise together);
    greedy rows need neither."""
    if penalties is None and all(p.greedy and not (p.logit_bias or p.allowed_token_ids) for p in params):  # argmax
        return argmax_last(logits.float(), nan_lowest=True)
    probs, u = _distributions(logits, params, draw_noise(seeds, positions, stream), penalties)
    return _invert(probs, u)


def sample(probs: torch.Tensor, seed: int, position: int, stream: Stream = Stream.TOKEN) -> int:
    """probs: [V] -> one token id (one host sync; not for the step loop)."""
    return int(sample_rows(probs[None], [seed], [position], stream)[0])


def uniform(seed: int, position: int, stream: Stream) -> float:
    return float(host_uniforms([seed], [position], stream)[0, 0])


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
    """norm(max(0, p_L - p_S)) over the last dim: what speculative sampling draws from after a rejection."""
    r = (p_large - p_small).clamp_min(0.0)  # [..., V]
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total, p_large)  # decided on the device: no host sync
