"""Teacher-forced quality of a routing: what every router is scored by, in training and in
the evaluation alike.

A router's score ranks the positions; at backoff rate b the lowest-scoring share b stays on
M_S and the rest goes to M_L, so the mixture's NLL of the actual text is
  NLL(b) = (Σ_{small} nll_s + Σ_{large} nll_l) / N.
`random` is the straight line between M_L (b=0) and M_S (b=1) in expectation. The gap a
router closes is measured between `random` and `oracle` (score = KL) on the area under
NLL(b) over b in [0, 1]: 1 = as good as the oracle, 0 = no better than chance.
"""

from __future__ import annotations

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
