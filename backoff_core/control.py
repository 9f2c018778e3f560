"""Online backoff-rate control: a request asks for a backoff rate, not a threshold.

A lookup table from calibration drifts as soon as the text differs from the calibration
set, so the threshold is steered during generation instead. The controller keeps a window
of this request's own scores: its set point is the target quantile of that window (the
threshold that WOULD have given the target rate on recent steps), and an integral term on
the achieved-vs-target error removes the bias the window alone leaves.
"""

from __future__ import annotations

from collections import deque

import torch


class RateController:
    def __init__(self, target: float, initial: float, window: int = 48, gain: float = 0.05) -> None:
        if not 0.0 <= target <= 1.0:
            raise ValueError(f"target backoff rate must be in [0, 1], got {target}")
        self.target = target
        self.threshold = initial
        self.gain = gain
        self._scores: deque[float] = deque(maxlen=window)
        self._integral = 0.0  # in quantile units
        self.steps = 0
        self.small_steps = 0

    def update(self, score: float, went_small: bool) -> float:
        """Record one step; returns the threshold for the next one."""
        self.steps += 1
        self.small_steps += int(went_small)
        if score == score and abs(score) != float("inf"):  # ignore NaN / forced steps
            self._scores.append(score)
        achieved = self.small_steps / self.steps
        # too few small steps -> raise the quantile we aim at, and vice versa
        self._integral = min(0.5, max(-0.5, self._integral + self.gain * (self.target - achieved)))
        if len(self._scores) >= 8:
            q = min(1.0, max(0.0, self.target + self._integral))
            scores = torch.tensor(list(self._scores))
            if q >= 1.0:
                self.threshold = float(scores.max()) + 1e-6
            else:
                self.threshold = float(torch.quantile(scores, q))
        return self.threshold
