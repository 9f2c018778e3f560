"""Statistical checks of sampling: the distributions tokens are drawn from are the right ones."""

from __future__ import annotations

import math

import pytest
import torch

from backoff_core.sampling import distribution, make_generator, sample
from backoff_core.types import SamplingParams, Verification
from helpers import engine_for, request

PROMPT = (3, 4, 5, 6)


def chi_square_critical(df: int, z: float = 3.72) -> float:
    """Wilson–Hilferty upper quantile of chi²(df); z = 3.72 is p ≈ 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic, pooling cells with expected count < 5 into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def test_top_k_and_top_p_on_a_hand_written_vector():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = distribution(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    p = distribution(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5+0.2 < 0.8 -> keep 3
    torch.testing.assert_close(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = distribution(logits, SamplingParams(temperature=1.0, top_p=0.5))  # the top token alone
    torch.testing.assert_close(p, torch.tensor([1.0, 0, 0, 0, 0]))
    p = distribution(logits, SamplingParams(temperature=0.0))
    torch.testing.assert_close(p, torch.tensor([1.0, 0, 0, 0, 0]))


def test_temperature_sharpens_and_flattens():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    cold = distribution(logits, SamplingParams(temperature=0.5))
    hot = distribution(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(cold, torch.tensor([0.36, 0.09, 0.01]) / 0.46)
    assert hot[2] > 0.1 > cold[2]


def test_sample_frequencies_match_probabilities():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    gen = make_generator(0)
    counts = torch.bincount(torch.tensor([sample(probs, gen) for _ in range(4000)]), minlength=4).float()
    stat, df = chi_square(counts, probs)
    assert stat < chi_square_critical(df)


@pytest.mark.parametrize("rate", [0.3, 0.7, 0.9])
def test_random_router_rate_within_binomial_bound(pair, tokenizer, rate):
    engine = engine_for(pair, tokenizer)
    results = engine.generate_many([request(PROMPT, 100, "random", rate=rate, seed=s) for s in range(20)])
    n = sum(len(r.sources) for r in results)
    observed = sum(r.sources.count(0) for r in results) / n
    sigma = math.sqrt(rate * (1 - rate) / n)
    assert abs(observed - rate) < 4.5 * sigma, (observed, rate, sigma)


def _large_marginals(large, prompt, params):
    """Exact distribution of the large model's first two sampled tokens: P(x1), P(x2)."""
    with torch.no_grad():
        p1 = distribution(large(torch.tensor([list(prompt)])).logits[0, -1], params)
        vocab = p1.shape[0]
        seqs = torch.tensor([list(prompt) + [x] for x in range(vocab)])
        p2_given = distribution(large(seqs).logits[:, -1], params)  # [V, V]
    return p1, p1 @ p2_given


@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_speculative_sampling_matches_large_distribution(soft_pair, tokenizer, draft_tokens):
    _, large = soft_pair
    params = SamplingParams(temperature=1.0, max_tokens=2)
    p1, p2 = _large_marginals(large, PROMPT, params)
    engine = engine_for(soft_pair, tokenizer)
    reqs = [
        request(PROMPT, 2, "draft", seed=s, temperature=1.0, draft_tokens=draft_tokens, verification=Verification.EXACT)
        for s in range(3000)
    ]
    results = []
    for i in range(0, len(reqs), 500):
        results += engine.generate_many(reqs[i : i + 500])
    assert any(r.rollbacks for r in results) and any(0 in r.sources for r in results)
    vocab = p1.shape[0]
    for position, probs in ((0, p1), (1, p2)):
        counts = torch.bincount(torch.tensor([r.token_ids[position] for r in results]), minlength=vocab).float()
        stat, df = chi_square(counts, probs)
        assert stat < chi_square_critical(df), (position, stat, df)


def test_pure_backoff_sampling_is_not_the_large_distribution(soft_pair, tokenizer):
    """The same statistic detects a wrong distribution (here: M_S's), so the test above can fail."""
    _, large = soft_pair
    params = SamplingParams(temperature=1.0, max_tokens=1)
    p1, _ = _large_marginals(large, PROMPT, params)
    engine = engine_for(soft_pair, tokenizer)
    results = engine.generate_many([request(PROMPT, 1, "always-small", seed=s, temperature=1.0) for s in range(3000)])
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=p1.shape[0]).float()
    stat, df = chi_square(counts, p1)
    assert stat > chi_square_critical(df)
