"""Router metrics and training: curves against brute force, heads that learn a separable
task (and do not on noise), standardisation folded into the checkpoint."""

from __future__ import annotations

import itertools

import pytest
import torch

from backoff_core.learning.metrics import area, gap_closed, nll_curve, random_curve, roc_auc, thresholds_for_rates
from backoff_core.learning.train import TrainConfig, fold_standardisation, save, train
from backoff_core.routing.head import ClassifierHead
from tests.support.router_fakes import one_thread, synthetic  # noqa: F401 (autouse fixture)


def test_nll_curve_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    score, nll_s, nll_l = torch.rand(50, generator=g), torch.rand(50, generator=g) * 3, torch.rand(50, generator=g)
    rates = torch.tensor([0.0, 0.1, 0.5, 0.74, 1.0])
    got = nll_curve(score, nll_s, nll_l, rates)
    for r, value in zip(rates, got):
        k = int(round(float(r) * 50))
        small = torch.zeros(50, dtype=torch.bool)
        small[torch.argsort(score)[:k]] = True
        assert float(value) == pytest.approx(float(torch.where(small, nll_s, nll_l).mean()), abs=1e-5)
    assert float(got[0]) == pytest.approx(float(nll_l.mean()), abs=1e-5)
    assert float(got[-1]) == pytest.approx(float(nll_s.mean()), abs=1e-5)


def test_gap_closed_is_one_for_the_oracle_and_near_zero_for_noise():
    data = synthetic(n=3000, seed=1)
    a_rand = area(random_curve(data.nll_s, data.nll_l))
    a_oracle = area(nll_curve(data.kl, data.nll_s, data.nll_l))
    assert gap_closed(a_oracle, a_rand, a_oracle) == 1.0
    noise = torch.rand(len(data), generator=torch.Generator().manual_seed(3))
    assert abs(gap_closed(area(nll_curve(noise, data.nll_s, data.nll_l)), a_rand, a_oracle)) < 0.1
    # the flipped oracle is worse than random
    assert gap_closed(area(nll_curve(-data.kl, data.nll_s, data.nll_l)), a_rand, a_oracle) < -0.5


def test_roc_auc_matches_pair_counting():
    score = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.4, 0.9])
    pos = torch.tensor([False, False, True, True, True, False])
    pairs = [(p, n) for p, n in itertools.product(score[pos], score[~pos])]
    expected = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)
    assert roc_auc(score, pos) == pytest.approx(expected)


def test_thresholds_give_the_rates_on_their_own_scores():
    s = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    rates = [0.0, 0.13, 0.5, 0.9, 1.0]
    for r, t in zip(rates, thresholds_for_rates(s, rates)):
        assert float((s < t).float().mean()) == pytest.approx(r, abs=1.5 / 1001)


@pytest.mark.parametrize("objective", ["binary", "regression", "buckets"])
def test_heads_learn_a_separable_task(objective):
    data = synthetic(n=4000, seed=0)
    cfg = TrainConfig(layer=1, objective=objective, inner_size=32, epochs=6, finetune_epochs=0, batch_size=128, lr=3e-3)
    head, log = train(cfg, data)
    rows = [r for r in log if r["epoch"] > 0]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]  # training reduces the loss
    assert head.meta.extra["val"]["gap_closed"] > 0.7
    assert head.meta.extra["val"]["auc_high_kl"] > 0.85


def test_a_head_learns_nothing_from_noise():
    data = synthetic(n=4000, seed=0, signal=False)
    cfg = TrainConfig(layer=1, objective="binary", inner_size=32, epochs=4, finetune_epochs=0, batch_size=128)
    head, _ = train(cfg, data)
    assert head.meta.extra["val"]["auc_high_kl"] < 0.65


def test_two_stage_training_logs_both_stages_and_reads_the_right_layer(tmp_path):
    pre, fine = synthetic(n=2000, seed=0), synthetic(n=1000, seed=5)
    cfg = TrainConfig(layer=-1, objective="binary", inner_size=16, epochs=2, finetune_epochs=2, batch_size=128)
    head, log = train(cfg, pre, fine)
    assert {r["stage"] for r in log} == {"pretrain", "finetune"}
    assert head.layer == 1 and head.meta.extra["t_kl"] == pytest.approx(float(torch.quantile(pre.kl.double(), 0.75)))
    save(head, log, tmp_path / "head")
    loaded = ClassifierHead.load(tmp_path / "head")
    x = pre.hidden[1][:10].float()
    assert torch.allclose(loaded.score(x), head.score(x), atol=1e-6)
    assert (tmp_path / "head" / "train_curve.png").stat().st_size > 1000


def test_standardisation_folds_into_the_first_layer():
    head = ClassifierHead.random(8)
    x = torch.randn(5, 8)
    mean, std = torch.randn(8), torch.rand(8) + 0.5
    with torch.no_grad():
        before = head((x - mean) / std)
        fold_standardisation(head, mean, std)
        assert torch.allclose(head(x), before, atol=1e-5)
