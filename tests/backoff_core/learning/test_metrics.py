"""backoff_core/learning/metrics.py: the NLL oracle as the true bound on NLL(b), and the
bootstrap over windows, on hand-made arrays."""

from __future__ import annotations

import itertools

import pytest
import torch

from backoff_core.learning.metrics import RATES, bootstrap_ci, gap_closed_all, nll_curve, nll_oracle_score, random_curve


def _positions(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # KL and M_S's extra NLL are related but not the same thing (the NLL is of one sampled token)
    g = torch.Generator().manual_seed(seed)
    kl = torch.rand(n, generator=g) * 3
    nll_l = 1.0 + torch.rand(n, generator=g)
    nll_s = nll_l + kl * torch.rand(n, generator=g) * 2 - 0.3
    return kl, nll_s, nll_l


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_nll_oracle_is_never_above_the_kl_oracle_or_random(seed):
    kl, nll_s, nll_l = _positions(seed=seed)  # 200 positions: every rate of RATES is a whole count
    best = nll_curve(nll_oracle_score(nll_s, nll_l), nll_s, nll_l)
    assert torch.all(best <= nll_curve(kl, nll_s, nll_l) + 1e-6)
    assert torch.all(best <= random_curve(nll_s, nll_l) + 1e-6)
    assert torch.all(best <= nll_curve(-kl, nll_s, nll_l) + 1e-6)


def test_the_kl_oracle_is_not_the_bound():
    # position 0: high KL but M_S happens to predict this token as well as M_L; position 1: the reverse
    kl = torch.tensor([5.0, 0.1])
    nll_s = torch.tensor([1.0, 4.0])
    nll_l = torch.tensor([1.0, 1.0])
    half = torch.tensor([0.5])
    assert float(nll_curve(kl, nll_s, nll_l, half)) == pytest.approx(2.5)  # keeps position 1 on M_S
    assert float(nll_curve(nll_oracle_score(nll_s, nll_l), nll_s, nll_l, half)) == pytest.approx(1.0)


def test_the_nll_oracle_is_the_exact_optimum_by_brute_force():
    nll_s = torch.tensor([2.0, 0.5, 3.0, 1.0, 4.0, 2.5])
    nll_l = torch.tensor([1.0, 1.5, 0.5, 1.0, 3.5, 0.2])
    n = len(nll_s)
    rates = torch.arange(n + 1) / n
    best = nll_curve(nll_oracle_score(nll_s, nll_l), nll_s, nll_l, rates)
    for k in range(n + 1):
        optimum = min(
            float(torch.where(torch.isin(torch.arange(n), torch.tensor(small, dtype=torch.long)), nll_s, nll_l).mean())
            for small in itertools.combinations(range(n), k)
        )
        assert float(best[k]) == pytest.approx(optimum, abs=1e-6)


def test_gap_closed_all_is_one_for_the_kl_oracle_and_above_for_the_nll_oracle():
    kl, nll_s, nll_l = _positions()
    gaps = gap_closed_all({"oracle": kl, "nll_oracle": nll_oracle_score(nll_s, nll_l)}, kl, nll_s, nll_l)
    assert gaps[0] == pytest.approx(1.0) and gaps[1] > 1.0


def _windows(counts: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))


def _mean(x: torch.Tensor) -> float:
    return float(x.double().mean())


def _window_means(w: int, per: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    # each window has its own level (positions inside one are alike), plus position noise
    g = torch.Generator().manual_seed(seed)
    windows = _windows([per] * w)
    return torch.randn(w, generator=g)[windows] + 0.1 * torch.randn(w * per, generator=g), windows


def test_the_bootstrap_is_deterministic_for_a_seed():
    x, windows = _window_means(10)
    a = bootstrap_ci(_mean, (x,), windows, n_boot=200, seed=3)
    assert torch.equal(a, bootstrap_ci(_mean, (x,), windows, n_boot=200, seed=3))
    assert not torch.equal(a, bootstrap_ci(_mean, (x,), windows, n_boot=200, seed=4))


def test_the_interval_contains_the_point_estimate():
    x, windows = _window_means(30)
    (lo, hi), point = bootstrap_ci(_mean, (x,), windows, n_boot=500)[0].tolist(), _mean(x)
    assert lo < point < hi


def test_the_interval_narrows_with_more_windows():
    x, windows = _window_means(10)
    y, more = _window_means(160)
    narrow = bootstrap_ci(_mean, (y,), more, n_boot=500)[0]
    wide = bootstrap_ci(_mean, (x,), windows, n_boot=500)[0]
    assert float(narrow[1] - narrow[0]) < 0.5 * float(wide[1] - wide[0])


def test_a_single_window_gives_a_zero_width_interval():
    x = torch.arange(50.0)  # positions differ, but every resample draws the one window whole
    lo, hi = bootstrap_ci(_mean, (x,), torch.zeros(50, dtype=torch.int32), n_boot=100)[0].tolist()
    assert lo == hi == pytest.approx(24.5)


def test_whole_windows_are_resampled_not_positions():
    # 4 windows of 50 alike positions (0, 0, 1, 1): by positions the mean of 200 would stay
    # within ~±0.07; by windows it swings by whole quarters
    x = torch.tensor([0.0, 0.0, 1.0, 1.0]).repeat_interleave(50)
    lo, hi = bootstrap_ci(_mean, (x,), _windows([50] * 4), n_boot=500)[0].tolist()
    assert lo <= 0.25 and hi >= 0.75


def test_a_resample_holds_every_position_of_each_drawn_window():
    # windows of 1, 3 and 96 positions: a resample's size is a sum of three of them
    windows = _windows([1, 3, 96])[torch.randperm(100, generator=torch.Generator().manual_seed(0))]
    sizes = set()

    def size_and_window_counts(w: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(w.long(), minlength=3)
        assert all(int(c) % n == 0 for c, n in zip(counts, (1, 3, 96)))  # whole windows only
        sizes.add(len(w))
        return torch.tensor([float(len(w))])

    bootstrap_ci(size_and_window_counts, (windows,), windows, n_boot=300)
    possible = {sum(c) for c in itertools.combinations_with_replacement((1, 3, 96), 3)}
    assert sizes <= possible and len(sizes) > 3


def test_a_statistic_of_several_values_gets_an_interval_each():
    x, windows = _window_means(30)
    ci = bootstrap_ci(lambda v: torch.stack([v.mean(), 2 * v.mean()]), (x,), windows, n_boot=200)
    assert ci.shape == (2, 2) and torch.allclose(ci[1], 2 * ci[0])


def test_rates_of_every_curve_include_eighty_percent():
    # the report states the NLL oracle's distance from M_L at 80% backoff, read off RATES
    assert bool(torch.isclose(RATES, torch.tensor(0.8)).any())
