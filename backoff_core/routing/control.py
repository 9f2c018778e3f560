"""Online backoff-rate control: a request asks for a backoff rate, not a threshold.

A threshold from calibration drifts as soon as the text differs from the calibration set
(the paper found the threshold-to-rate map "varied broadly across benchmarks"), so the
threshold is steered during generation instead:

  T_t = Q_t(q_t),   q_t = clip(b* + k · D_t, 0, 1),   D_t = b*·t − s_t

- Q_t is the quantile function of the scores this request has produced so far, pooled
  with a prior (the router's calibration table, worth `prior_weight` steps) so the first
  steps are already near the right threshold. Using all of the request's scores (not a
  short window) keeps routing by *difficulty*: a hard passage still goes to M_L rather
  than the threshold following its level up.
- D_t is the deficit of small steps (b*·t expected, s_t taken): an integral of the rate
  error. Feeding it back as a quantile offset makes D a mean-reverting walk
  (E[ΔD] = −k·D), so the achieved rate converges to b* whatever the scores do, with
  |D| of a few steps: the error in rate is O(1/t).
- k = 1 / min(1/gain, steps left): when the request's horizon is known (the engine passes
  max_tokens only for a request that cannot end earlier: `ignore_eos` and no stop strings),
  the deficit is paid back by the last step, so the request lands on b* within a token. A
  request that may end at EOS has an open horizon: the feedback alone keeps |D| to a few
  steps, so a short answer can end a few points off. A small gain keeps the routing by score early on (on correlated
  synthetic scores, gain 0.05 kept ~70-90% precision on the truly hard steps where 0.2
  kept ~50-75%); the horizon then makes the tracking exact anyway.
"""

from __future__ import annotations

import math
import sys
from collections import deque

import torch

# the thresholds of "every step large" / "every step small": finite, so they stay finite in
# float64 and in JSON (±inf broke responses), and every finite score lies between them
LOWEST, HIGHEST = -sys.float_info.max, sys.float_info.max


class RateController:
    def __init__(
        self,
        target: float,
        initial: float,
        prior: torch.Tensor | None = None,
        *,
        horizon: int | None = None,
        gain: float = 0.05,
        prior_weight: float = 16.0,
        window: int = 1024,
    ) -> None:
        if not 0.0 <= target <= 1.0:
            raise ValueError(f"target backoff rate must be in [0, 1], got {target}")
        self.target = target
        self.gain = gain
        self.horizon = horizon
        self.prior_weight = prior_weight
        self._prior = torch.sort(prior.double()).values if prior is not None and len(prior) else None
        self._scores: deque[float] = deque(maxlen=window)
        self.steps = 0
        self.small_steps = 0
        if target in (0.0, 1.0) or self._prior is not None:
            self.threshold = self._quantile(target)  # LOWEST / HIGHEST at the extremes
        else:
            self.threshold = initial

    @property
    def deficit(self) -> float:
        """Small steps owed: target · steps − small steps (> 0: too few stayed small)."""
        return self.target * self.steps - self.small_steps

    @property
    def achieved(self) -> float:
        return self.small_steps / self.steps if self.steps else float("nan")

    def update(self, score: float, went_small: bool) -> float:
        """Record one step (its score, whether it stayed on M_S); returns the next threshold."""
        self.steps += 1
        self.small_steps += int(went_small)
        if math.isfinite(score):
            self._scores.append(score)
        # pay the deficit back over 1/gain steps, or over the steps left if fewer
        payback = 1.0 / self.gain
        if self.horizon is not None:
            payback = max(1.0, min(payback, self.horizon - self.steps))
        q = min(1.0, max(0.0, self.target + self.deficit / payback))
        if self._scores or self._prior is not None:
            self.threshold = self._quantile(q)
        return self.threshold

    def _quantile(self, q: float) -> float:
        """T with a share q of the pooled (request + prior) scores below it."""
        if not q > 0.0:  # NaN too: a guard, never a NaN threshold
            return LOWEST  # every step large
        if q >= 1.0:
            return HIGHEST  # every step small
        own = torch.tensor(list(self._scores), dtype=torch.float64)
        values, weights = own, torch.ones_like(own)
        if self._prior is not None:
            values = torch.cat([own, self._prior])
            weights = torch.cat([weights, torch.full_like(self._prior, self.prior_weight / len(self._prior))])
        order = torch.argsort(values)
        values, cum = values[order], weights[order].cumsum(0) / weights.sum()
        k = int(torch.searchsorted(cum, torch.tensor(q, dtype=torch.float64)))  # first with cum >= q
        if k >= len(values) - 1:
            top = float(values[-1])
            return min(HIGHEST, top + 1e-6 * max(1.0, abs(top)))
        return float(values[k] / 2 + values[k + 1] / 2)  # halves first: no overflow near the float limit


def rate_prior(router) -> torch.Tensor | None:
    """Scores a router is expected to give, as an equally weighted sample (or None).

    A calibrated classifier's table maps rates on a grid to score quantiles: its interior
    thresholds are that sample. `random` scores are U(0, 1).
    """
    head = getattr(router, "head", None)
    table = sorted(getattr(getattr(head, "meta", None), "calibration", ()) or ())
    interior = [t for r, t in table if 0.0 < r < 1.0 and math.isfinite(t)]
    if interior:
        return torch.tensor(interior, dtype=torch.float64)
    if getattr(router, "name", "") == "random":
        return torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
    return None
