"""`backoff router-calibrate`: the table from backoff rate to threshold, on a calibration set.

The head scores every position of the calibration data; the threshold for rate b is the
b-quantile of those scores (score >= T -> M_L), so on this set the achieved rate is b up to
one position. The table lands in head.json (`calibration`), where `ClassifierHead.
threshold_for_rate` reads it and the rate controller uses it as its prior.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from backoff_core.learning.data import RouterData
from backoff_core.learning.metrics import thresholds_for_rates
from backoff_core.routing.head import ClassifierHead

DEFAULT_RATES = tuple(round(i / 50, 4) for i in range(51))


def head_scores(head: ClassifierHead, data: RouterData) -> torch.Tensor:
    """[N] the head's score for every position (what the engine compares to the threshold)."""
    from backoff_core.learning.train import data_scores

    if head.layer not in data.hidden:
        raise ValueError(f"the head reads layer {head.layer}; this data has layers {sorted(data.hidden)}")
    return data_scores(head, data)


def achieved_rates(scores: torch.Tensor, thresholds) -> list[float]:
    """Share of positions that would stay small (score < T) at each threshold."""
    s = scores.float()
    return [float((s < torch.tensor(t, dtype=torch.float32)).float().mean()) for t in thresholds]


def calibrate(head: ClassifierHead, data: RouterData, rates=DEFAULT_RATES, source: str = "") -> dict:
    """Write the calibration table into `head.meta`; returns a summary (rates, thresholds, achieved)."""
    if any(not 0.0 <= r <= 1.0 for r in rates):
        raise ValueError("calibration rates must be in [0, 1]")
    rates = sorted(set(float(r) for r in rates))
    scores = head_scores(head, data)
    thresholds = thresholds_for_rates(scores, rates)
    achieved = achieved_rates(scores, thresholds)
    table = tuple((r, t) for r, t in zip(rates, thresholds))
    extra = dict(
        head.meta.extra,
        calibration_source=source,
        calibration_positions=len(scores),
        calibration_max_error=max(abs(a - r) for a, r in zip(achieved, rates)),
    )
    head.meta = replace(head.meta, calibration=table, extra=extra)
    return {"rates": rates, "thresholds": thresholds, "achieved": achieved, "positions": len(scores)}


def calibrate_dir(head_dir: str | Path, data: RouterData, rates=DEFAULT_RATES, source: str = "") -> dict:
    head = ClassifierHead.load(head_dir)
    summary = calibrate(head, data, rates, source)
    head.save(head_dir)
    return summary
