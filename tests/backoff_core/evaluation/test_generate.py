"""Generation figures from per-prompt counts (backoff_core/evaluation/generate.py, control.py):
pooling, routers interpolated to matched rates with paired bootstrap intervals, and the rate
error's interval over requests, on hand-written counts."""

from __future__ import annotations

import pytest

from backoff_core.evaluation.control import rate_error_ci
from backoff_core.evaluation.generate import matched, pooled


def per_prompt(small, nll, tokens=(10, 10, 10, 10)) -> dict:
    return {"tokens": list(tokens), "small": list(small), "nll": list(nll), "agree": [t // 2 for t in tokens]}


def run(router: str, nominal: float, small, nll) -> dict:
    p = per_prompt(small, nll)
    return {"label": f"{router}@{nominal}", "router": router, **pooled(p), "per_prompt": p}


def test_pooled_weights_every_prompt_by_its_tokens():
    p = per_prompt([1, 9], [2.0, 18.0], tokens=(2, 18))
    assert pooled(p) == {"backoff_rate": 0.5, "large_nll": 1.0, "agreement": 0.5}
    assert pooled(p, [1, 1]) == {"backoff_rate": 0.5, "large_nll": 1.0, "agreement": 0.5}


def test_matched_interpolates_between_the_runs_that_bracket_the_rate():
    rows = [
        run("classifier", 0.4, [4, 4, 4, 4], [10, 10, 10, 10]),  # rate 0.4, NLL 1.0
        run("classifier", 0.6, [6, 6, 6, 6], [20, 20, 20, 20]),  # rate 0.6, NLL 2.0
        run("random", 0.4, [4, 4, 4, 4], [12, 12, 12, 12]),
        run("random", 0.6, [6, 6, 6, 6], [22, 22, 22, 22]),
        {"label": "M_L", "router": "always-large", **pooled(per_prompt([0] * 4, [5] * 4))},
    ]
    m = matched(rows, (0.5, 0.9), n_boot=200)
    at = m["routers"]["classifier"]["0.5"]
    assert at["large_nll"] == pytest.approx(1.5) and at["minus_random_nll"] == pytest.approx(-0.2)
    assert at["ci95_minus_random_nll"] == pytest.approx([-0.2, -0.2])  # paired: every prompt differs by 0.2
    assert m["routers"]["classifier"]["0.9"] is None  # outside the measured rates: never extrapolated
    assert set(m["routers"]) == {"classifier", "random"} and m["prompts"] == 4


def test_matched_intervals_widen_with_prompts_that_disagree():
    rows = [
        run("classifier", 0.4, [4, 4, 4, 4], [5, 15, 5, 15]),
        run("classifier", 0.6, [6, 6, 6, 6], [15, 25, 15, 25]),
    ]
    lo, hi = matched(rows, (0.5,), n_boot=400)["routers"]["classifier"]["0.5"]["ci95_nll"]
    assert lo < 1.5 < hi and hi - lo > 0.3


def test_rate_error_interval_over_requests():
    assert rate_error_ci([5, 5, 5], [10, 10, 10], 0.4, "k") == pytest.approx([0.1, 0.1])
    lo, hi = rate_error_ci([0, 10, 5, 5], [10, 10, 10, 10], 0.5, "k")
    assert lo < 0.0 < hi
