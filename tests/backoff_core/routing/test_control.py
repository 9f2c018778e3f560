"""Calibration hits its rates on its own set; the rate controller tracks targets on score
streams that a fixed threshold misses, and inside the engine."""

from __future__ import annotations

import json

import pytest
import torch

from backoff_core.learning.calibrate import achieved_rates, calibrate, calibrate_dir, head_scores
from backoff_core.learning.train import TrainConfig, save, train
from backoff_core.routing.control import RateController, rate_prior
from backoff_core.routing.head import ClassifierHead
from backoff_core.routing.routers import Classifier
from tests.support.helpers import engine_for, request
from tests.support.router_fakes import one_thread, synthetic  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def trained_head():
    cfg = TrainConfig(layer=1, objective="regression", inner_size=16, epochs=2, finetune_epochs=0, batch_size=256)
    return train(cfg, synthetic(n=2000, seed=0))


def test_calibration_hits_its_rates_on_the_calibration_set(trained_head, tmp_path):
    head, log = trained_head
    calib = synthetic(n=1500, seed=7)
    rates = (0.0, 0.25, 0.5, 0.7, 0.9, 1.0)
    summary = calibrate(head, calib, rates)
    scores = head_scores(head, calib)
    for r, a in zip(rates, achieved_rates(scores, summary["thresholds"])):
        assert a == pytest.approx(r, abs=1.0 / 1500)
    # the table interpolates between its points and lands in head.json
    assert head.threshold_for_rate(0.6) == pytest.approx((summary["thresholds"][2] + summary["thresholds"][3]) / 2)
    save(head, log, tmp_path / "h")
    again = calibrate_dir(tmp_path / "h", calib, (0.3, 0.8))
    table = json.loads((tmp_path / "h" / "head.json").read_text())["calibration"]
    assert [r for r, _ in table] == [0.3, 0.8] and again["positions"] == 1500


def _stream(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "iid":
        return torch.randn(n, generator=g)
    if kind == "shifted":  # another domain: the calibration prior is off by a whole sd
        return torch.randn(n, generator=g) * 1.5 + 1.0
    if kind == "drift":  # scores fall as text turns repetitive
        return torch.randn(n, generator=g) + torch.linspace(1.0, -1.0, n)
    x = torch.zeros(n)  # AR(1): hard and easy passages
    for t in range(1, n):
        x[t] = 0.9 * x[t - 1] + 0.45 * float(torch.randn((), generator=g))
    return x


def _simulate(controller: RateController, scores: torch.Tensor) -> float:
    small = 0
    for s in scores.tolist():
        went_small = s < controller.threshold
        small += went_small
        controller.update(s, went_small)
    return small / len(scores)


PRIOR = torch.randn(200, generator=torch.Generator().manual_seed(99))  # calibration scores ~ N(0, 1)


@pytest.mark.parametrize("kind", ["iid", "shifted", "drift", "ar1"])
@pytest.mark.parametrize("target", [0.5, 0.7, 0.9])
def test_controller_tracks_the_target_on_score_streams(kind, target):
    # horizon known (the engine passes max_tokens): the deficit is paid back by the end
    errors = [
        _simulate(RateController(target, 0.0, prior=PRIOR, horizon=128), _stream(kind, 128, seed)) - target
        for seed in range(8)
    ]
    assert max(abs(e) for e in errors) <= 0.01, errors
    # horizon unknown: the deficit feedback alone still keeps the rate close
    errors = [
        _simulate(RateController(target, 0.0, prior=PRIOR), _stream(kind, 256, seed)) - target for seed in range(8)
    ]
    assert max(abs(e) for e in errors) <= 0.04, errors


def test_a_fixed_calibrated_threshold_misses_on_a_shifted_domain():
    """Why a controller: the same calibration table as a lookup is far off on shifted scores."""
    fixed = float(torch.quantile(PRIOR, 0.7))
    achieved = float((_stream("shifted", 2000, 0) < fixed).float().mean())
    assert abs(achieved - 0.7) > 0.15


def test_controller_still_routes_by_difficulty():
    scores = _stream("iid", 2000, 3)
    c = RateController(0.7, 0.0, prior=PRIOR, horizon=2000)
    large = []
    for s in scores.tolist():
        large.append(s >= c.threshold)
        c.update(s, not large[-1])
    truly_hard = scores >= torch.quantile(scores, 0.7)
    precision = float((truly_hard & torch.tensor(large)).sum()) / sum(large)
    assert precision > 0.8


def test_controller_extremes_and_prior():
    assert _simulate(RateController(1.0, 0.0), _stream("iid", 50, 0)) == 1.0
    assert _simulate(RateController(0.0, 0.0), _stream("iid", 50, 0)) == 0.0
    c = RateController(0.5, 123.0, prior=PRIOR)
    assert c.threshold == pytest.approx(float(PRIOR.median()), abs=0.05)  # starts from the table, not `initial`
    with pytest.raises(ValueError):
        RateController(1.5, 0.0)


def test_rate_prior_reads_the_calibration_table():
    head = ClassifierHead.random(8)
    assert rate_prior(Classifier(head)) is None
    from dataclasses import replace

    head.meta = replace(head.meta, calibration=((0.0, -1.0), (0.5, 0.2), (1.0, 3.0)))
    assert rate_prior(Classifier(head)).tolist() == [0.2]


def test_controller_in_the_engine(pair, tokenizer):
    """Each request asks for a rate; the engine steers its threshold as it generates."""
    engine = engine_for(pair, tokenizer)
    targets = [0.5, 0.7, 0.9] * 2
    reqs = [
        request([3 + i, 9, 17, 4], max_tokens=50, router="entropy", target_backoff=t, temperature=1.0, seed=i)
        for i, t in enumerate(targets)
    ]
    results = engine.generate_many(reqs)
    rates = [r.backoff_rate for r in results]
    assert all(abs(r - t) <= 0.03 for r, t in zip(rates, targets)), rates
    assert all(r.thresholds[0] != 2.0 for r in results)  # steered away from the router default


def test_the_default_pair_gets_the_committed_head(pair, tokenizer):
    from backoff_core.models.default_pair import DEFAULT_HEAD_DIR, default_head_dir
    from backoff_core.models.loading import Chain

    assert default_head_dir(Chain(tuple(pair), tokenizer, ("a", "b"))) is None
    if not (DEFAULT_HEAD_DIR / "head.json").exists():
        pytest.skip("no committed router head")
    head = ClassifierHead.load(DEFAULT_HEAD_DIR)
    assert head.meta.calibration and head.meta.hidden_size == 576
    with pytest.warns(UserWarning, match="another M_S"):  # tiny M_S: not the one the head was trained on
        assert default_head_dir(Chain(tuple(pair), tokenizer, ("default-small", "default-large"))) == str(
            DEFAULT_HEAD_DIR
        )
