"""Teacher-forced quality of a routing: what every router is scored by, in training and in
the evaluation alike.

A router's score ranks the positions; at backoff rate b the lowest-scoring share b stays on
M_S and the rest goes to M_L, so the mixture's NLL of the actual text is
  NLL(b) = (Σ_{small} nll_s + Σ_{large} nll_l) / N.
`random` is the straight line between M_L (b=0) and M_S (b=1) in expectation. The gap a
router closes is measured between `random` and `oracle` (score = KL) on the area under
NLL(b) over b in [0, 1]: 1 = as good as the oracle, 0 = no better than chance.
The KL oracle is not the best routing of the text's NLL: `nll_oracle_score` (route by each
position's true NLL difference, known only in hindsight) is, at every rate; its gap closed
exceeds 1 by what KL routing leaves on the table. `bootstrap_ci` resamples whole windows
(positions of one window are correlated) for 95% intervals of any of these statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

RATES = torch.linspace(0.0, 1.0, 51)  # backoff rates of every curve


def nll_curve(
    score: torch.Tensor, nll_s: torch.Tensor, nll_l: torch.Tensor, rates: torch.Tensor = RATES
) -> torch.Tensor:
    """[R] mixture NLL when the lowest-scoring share `rate` of positions stays on M_S."""
    n = len(score)
    order = torch.argsort(score.double(), stable=True)
    zero = torch.zeros(1, dtype=torch.float64)
    small = torch.cat([zero, nll_s.double()[order].cumsum(0)])  # [N+1] Σ nll_s of the k lowest
    large = torch.cat([zero, nll_l.double()[order].cumsum(0)])
    k = (rates.double() * n).round().long()
    return ((small[k] + large[-1] - large[k]) / n).float()


def random_curve(nll_s: torch.Tensor, nll_l: torch.Tensor, rates: torch.Tensor = RATES) -> torch.Tensor:
    return (rates * nll_s.double().mean() + (1 - rates) * nll_l.double().mean()).float()


def area(curve: torch.Tensor, rates: torch.Tensor = RATES) -> float:
    return float(torch.trapezoid(curve.double(), rates.double()))


def gap_closed(router: float, random: float, oracle: float) -> float:
    """Share of the random→oracle area gap a router closes (areas under NLL(b))."""
    return (random - router) / (random - oracle) if random != oracle else float("nan")


def nll_oracle_score(nll_s: torch.Tensor, nll_l: torch.Tensor) -> torch.Tensor:
    """[N] what M_L gains at each position: sending the highest share to M_L minimises
    Σ nll over the routing at every backoff rate (an exchange argument), so its NLL(b) is
    the lower envelope no router can go below on this text."""
    return nll_s.double() - nll_l.double()


def gap_closed_all(
    scores: dict[str, torch.Tensor], kl: torch.Tensor, nll_s: torch.Tensor, nll_l: torch.Tensor
) -> torch.Tensor:
    """[K] gap closed of each score (in dict order), against random and the KL oracle."""
    a_rand = area(random_curve(nll_s, nll_l))
    a_oracle = area(nll_curve(kl, nll_s, nll_l))
    return torch.tensor(
        [gap_closed(area(nll_curve(s, nll_s, nll_l)), a_rand, a_oracle) for s in scores.values()], dtype=torch.float64
    )


def bootstrap_ci(
    statistic: Callable[..., torch.Tensor | float],
    arrays: Sequence[torch.Tensor],
    windows: torch.Tensor,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> torch.Tensor:
    """[K, 2] percentile interval (2.5/97.5 at level 0.95) of statistic(*arrays) -> [K] (or a
    float, K = 1), resampling whole windows with replacement: each replicate draws as many
    windows as there are, and keeps every position of each draw (a window drawn twice counts
    twice). arrays: [N] each, aligned with windows [N] (window id per position)."""
    order = torch.argsort(windows, stable=True)
    _, counts = torch.unique_consecutive(windows[order], return_counts=True)  # [W] positions per window
    starts = counts.cumsum(0) - counts  # [W] first slot of each window in `order`
    g = torch.Generator().manual_seed(seed)
    stats = []
    for _ in range(n_boot):
        pick = torch.randint(len(counts), (len(counts),), generator=g)  # [W] windows drawn
        lens = counts[pick]
        # slot of each resampled position: its window's start + its offset inside the window
        offset = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
        idx = order[torch.repeat_interleave(starts[pick], lens) + offset]
        stats.append(torch.as_tensor(statistic(*(a[idx] for a in arrays)), dtype=torch.float64).reshape(-1))
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    # a replicate with random == oracle has no gap (nan): left out rather than poisoning the interval
    return torch.nanquantile(torch.stack(stats), q, dim=0).T  # [K, 2]


def roc_auc(score: torch.Tensor, positive: torch.Tensor) -> float:
    """P(score of a random positive > score of a random negative), ties counted half."""
    pos, neg = int(positive.sum()), int((~positive).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    ranks = _average_ranks(score.double())
    return float((ranks[positive].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(x)
    sorted_x = x[order]
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(1, len(x) + 1, dtype=x.dtype)
    # ties: average rank of the run
    _, inverse, counts = torch.unique_consecutive(sorted_x, return_inverse=True, return_counts=True)
    run_end = counts.cumsum(0).double()
    mean_rank = run_end - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return ranks


@dataclass(frozen=True)
class Quality:
    """How well one score routes a set of positions."""

    area: float  # under NLL(b), b in [0, 1]
    gap_closed: float  # vs random and the oracle on the same positions
    auc_high_kl: float  # ROC AUC of the score for KL > t_kl
    curve: tuple[float, ...]


def quality(score: torch.Tensor, kl: torch.Tensor, nll_s: torch.Tensor, nll_l: torch.Tensor, t_kl: float) -> Quality:
    curve = nll_curve(score, nll_s, nll_l)
    a = area(curve)
    a_random = area(random_curve(nll_s, nll_l))
    a_oracle = area(nll_curve(kl, nll_s, nll_l))
    return Quality(a, gap_closed(a, a_random, a_oracle), roc_auc(score, kl > t_kl), tuple(curve.tolist()))


def thresholds_for_rates(score: torch.Tensor, rates) -> list[float]:
    """Threshold T per rate so that P(score < T) = rate on these scores (score >= T -> large)."""
    s = torch.sort(score.float()).values  # float32, as the engine compares them
    n = len(s)
    out = []
    for r in rates:
        k = int(round(float(r) * n))
        if k <= 0:
            out.append(float(s[0]))  # every score >= the minimum: all large
        elif k >= n:
            out.append(float(torch.nextafter(s[-1], torch.tensor(float("inf")))))
        else:
            out.append(float((s[k - 1] + s[k]) / 2) if s[k] > s[k - 1] else float(s[k]))
    return out
