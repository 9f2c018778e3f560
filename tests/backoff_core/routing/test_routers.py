"""Decision functions on hand-written inputs, and their level mapping in the engine."""

from __future__ import annotations

import math

import pytest
import torch

from backoff_core import sampling
from backoff_core.engine.host import to_host
from backoff_core.routing.head import ClassifierHead, HeadMeta
from backoff_core.routing.routers import NAMES, Random, StepContext, build_router
from tests.support.helpers import engine_for, request

PROMPT = (3, 4, 5, 6)


def ctx(small, large=None, hidden=None):
    b = small.shape[0]
    return StepContext(small, hidden, large, torch.zeros(b), torch.full((b,), 0.5))


def test_scores_on_hand_written_logits():
    uniform4 = torch.zeros(1, 4)
    peaked = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    both = torch.cat([uniform4, peaked])
    assert build_router("entropy").scores(ctx(both))[0] == pytest.approx(math.log(4), abs=1e-5)
    assert build_router("entropy").scores(ctx(both))[1] < 0.01
    assert build_router("max-prob").scores(ctx(both))[0] == pytest.approx(0.75, abs=1e-6)
    kl = build_router("oracle").scores(ctx(uniform4, large=peaked))
    p = torch.softmax(peaked, -1)[0]
    expected = float((p * (p.log() - math.log(0.25))).sum())
    assert kl[0] == pytest.approx(expected, rel=1e-5)
    assert build_router("flipped-oracle").scores(ctx(uniform4, large=peaked))[0] == pytest.approx(-expected, rel=1e-5)
    assert build_router("always-small").scores(ctx(both)).tolist() == [-math.inf, -math.inf]
    assert build_router("random", rate=0.3).default_thresholds(2) == (0.3,)


def test_unknown_router_names_the_choices():
    with pytest.raises(ValueError, match="choose one of .*entropy"):
        build_router("bogus")
    assert {
        "oracle",
        "flipped-oracle",
        "classifier",
        "entropy",
        "max-prob",
        "random",
        "always-small",
        "always-large",
    } <= set(NAMES)


def test_router_head_round_trip_and_calibration(tmp_path):
    head = ClassifierHead(HeadMeta(hidden_size=8, layer=1, inner_size=16, calibration=((0.5, 0.2), (0.9, 0.6))))
    head.save(tmp_path)
    loaded = ClassifierHead.load(tmp_path)
    h = torch.randn(5, 8)
    torch.testing.assert_close(head.score(h), loaded.score(h))
    assert loaded.threshold_for_rate(0.7) == pytest.approx(0.4)
    with pytest.raises(FileNotFoundError, match="no router head"):
        ClassifierHead.load(tmp_path / "missing")


def test_classifier_router_reads_the_small_hidden_state(pair, tokenizer):
    """A random head at the last layer: the engine hands it M_S's hidden states."""
    small, _ = pair
    engine = engine_for(pair, tokenizer, hidden_size=small.config.hidden_size)
    result = engine.generate(request(PROMPT, 20, "classifier", thresholds=(0.5,)))
    head = engine.routers.built[("classifier", None, 4)].head
    # recompute the head's decision at each step from M_S's own hidden state
    tokens = list(PROMPT) + list(result.token_ids)
    with torch.no_grad():
        hidden = small(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    scores = head.score(hidden[len(PROMPT) - 1 : -1])
    assert tuple(int(s >= 0.5) for s in scores) == result.sources


def test_chain_levels_follow_thresholds(chain3, tokenizer):
    engine = engine_for(chain3, tokenizer)
    result = engine.generate(request(PROMPT, 200, "random", seed=0, thresholds=(0.2, 0.6)))
    shares = [result.sources.count(level) / 200 for level in range(3)]
    for share, expected in zip(shares, (0.2, 0.4, 0.4)):
        assert abs(share - expected) < 4.5 * math.sqrt(expected * (1 - expected) / 200)


def test_classifier_and_other_routers_share_a_step(pair, tokenizer):
    small, _ = pair
    engine = engine_for(pair, tokenizer, hidden_size=small.config.hidden_size)
    reqs = [
        request(PROMPT, 8, "classifier", thresholds=(0.5,)),
        request(PROMPT, 8, "entropy"),
        request(PROMPT, 8, "random", seed=1, rate=0.5),
    ]
    together = engine.generate_many(reqs)
    assert [r.token_ids for r in together] == [engine.generate(r).token_ids for r in reqs]


@pytest.mark.parametrize("name", ["always-small", "random"])
def test_host_scores_are_the_device_scores_bit_for_bit(name):
    # a router whose scores are host data scores on the host (propose.py): the values must
    # be the ones scores() gives on the device and the step loop would read back
    router = build_router(name, rate=0.5)
    assert router.scores_on_host
    seeds, positions = [0, 7, 2**40 + 3, 12345], [4, 5, 6, 1000]
    u = sampling.uniforms(seeds, positions, sampling.Stream.ROUTER)[:, 0]
    device = StepContext(torch.zeros(4, 8), None, None, torch.zeros(4, dtype=torch.long), u)
    on_device = to_host(router.scores(device))[0]
    on_host = router.host_scores(4, sampling.host_uniforms(seeds, positions, sampling.Stream.ROUTER)[:, 0])
    assert on_host == on_device and all(type(v) is float for v in on_host)


def test_a_subclass_that_rescores_scores_on_the_device():
    class Biased(Random):
        def scores(self, ctx):  # a new score: the host version would be the parent's
            return ctx.uniforms * 0 + 2.0

    class Shifted(Random):
        def scores(self, ctx):
            return ctx.uniforms + 1.0

        def host_scores(self, n, uniforms):
            return (uniforms + 1.0).tolist()

    assert not Biased.scores_on_host and Biased.reads_uniforms and Shifted.scores_on_host
    assert not build_router("entropy").scores_on_host and not build_router("oracle").scores_on_host


def test_random_routes_by_its_seeded_coin_on_the_host(pair, tokenizer):
    # random at rate 0.5: a step goes large exactly when its ROUTER-stream uniform reaches 0.5
    # (what the device path gave before host scores), and a rescored subclass is obeyed
    engine = engine_for(pair, tokenizer)
    out = engine.generate(request(PROMPT, 24, "random", seed=5, rate=0.5))
    positions = list(range(len(PROMPT), len(PROMPT) + 24))
    coins = sampling.host_uniforms([5] * 24, positions, sampling.Stream.ROUTER)[:, 0]
    assert list(out.sources) == [int(u >= 0.5) for u in coins]
    assert 0 < sum(out.sources) < 24

    class Always(Random):
        def scores(self, ctx):
            return ctx.uniforms * 0 + 2.0  # above any rate: every step large

    forced = engine.generate(request(PROMPT, 6, "random", seed=5, rate=0.5), router=Always(0.5))
    assert list(forced.sources) == [1] * 6
