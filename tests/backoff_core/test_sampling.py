"""Statistical checks of sampling: the distributions tokens are drawn from are the right ones."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from backoff_core import sampling
from backoff_core.sampling import Stream, argmax_last, distribution, distributions, draw, sample, sample_rows, uniforms
from backoff_core.types import SamplingParams, Verification
from tests.support.helpers import engine_for, request

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


def test_argmax_last_is_torchs_argmax_ties_nan_and_views_included():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 300), generator=g).float()  # many ties: the first maximum wins
    x[5, 7] = x[9, 0] = float("nan")  # a NaN is the maximum, as in torch
    x[11] = float("-inf")
    for t in (x, x[:, 1:], x[::2], x.T.contiguous().T, torch.randn(3, 49152, generator=g)):
        got = argmax_last(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(-1))
    assert argmax_last(x)[[5, 9, 11]].tolist() == [7, 0, 0]


def test_argmax_last_stays_on_a_non_cpu_device():
    x = torch.empty(4, 300, device="meta")  # no data: a host read would raise
    for nan_lowest in (False, True):
        got = argmax_last(x, nan_lowest=nan_lowest)
        assert got.device.type == "meta" and got.shape == (4,) and got.dtype == torch.int64


def test_argmax_last_nan_lowest_is_the_argmax_with_nan_as_minus_inf():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4, (64, 300), generator=g).float()
    x[5, 7] = x[9, 0] = x[9, 299] = float("nan")  # NaN where the first maximum would be
    x[13] = float("nan")  # all NaN: every value is -inf, the first wins
    x[17] = float("-inf")
    x[17, 40] = float("nan")
    x[21, 3] = float("nan")  # a NaN that is not the row's maximum changes nothing
    x[21, 10] = 9.0
    for t in (x, x[:, 1:], x[::2], x.T.contiguous().T):
        got = argmax_last(t, nan_lowest=True)
        assert got.dtype == torch.int64 and torch.equal(got, torch.nan_to_num(t, nan=float("-inf")).argmax(-1))
    assert argmax_last(x, nan_lowest=True)[[13, 17, 21]].tolist() == [0, 0, 10]
    assert not torch.isnan(x[[5, 9], argmax_last(x, nan_lowest=True)[[5, 9]]]).any()
    assert argmax_last(x)[5] == 7  # without it, a NaN is the maximum


def test_greedy_draws_skip_nan_and_match_the_one_hot_distribution():
    logits = torch.tensor([[0.0, 2.0, float("nan"), 1.0], [3.0, 3.0, -1.0, float("nan")]])
    greedy = [SamplingParams(temperature=0.0)] * 2
    assert draw(logits, greedy, [1, 2], [0, 0]).tolist() == [1, 0]
    assert distributions(logits, greedy).argmax(-1).tolist() == [1, 0]


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


def test_min_p_keeps_tokens_within_its_share_of_the_likeliest_after_temperature():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = torch.log(probs)
    # at temperature 1: keep p >= 0.3 x 0.5 = 0.15 (tokens 0, 1, 2), renormalised
    got = distribution(logits, SamplingParams(temperature=1.0, min_p=0.3))
    torch.testing.assert_close(got, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    # after temperature 0.5 the shares are squared: 0.2^2/0.5^2 = 0.16 >= 0.15 keeps token 1 only
    sharp = distribution(logits, SamplingParams(temperature=0.5, min_p=0.15))
    kept = torch.tensor([0.25, 0.04, 0, 0, 0])
    torch.testing.assert_close(sharp, kept / kept.sum())
    # beside top-k in a batch, each row its own; min_p 0 and 1 are off and the argmax alone
    rows = [SamplingParams(temperature=1.0, min_p=0.3, top_k=2), SamplingParams(temperature=1.0, min_p=0.0)]
    p = distributions(logits.expand(2, 5), rows)
    torch.testing.assert_close(p[0], torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    torch.testing.assert_close(p[1], probs)
    assert distribution(logits, SamplingParams(temperature=1.0, min_p=1.0)).tolist() == [1.0, 0, 0, 0, 0]


def test_temperature_sharpens_and_flattens():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    cold = distribution(logits, SamplingParams(temperature=0.5))
    hot = distribution(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(cold, torch.tensor([0.36, 0.09, 0.01]) / 0.46)
    assert hot[2] > 0.1 > cold[2]


@pytest.mark.parametrize("vary", ["position", "seed"])
def test_sample_frequencies_match_probabilities(vary):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 4000
    seeds = [7] * n if vary == "position" else list(range(n))
    positions = list(range(n)) if vary == "position" else [5] * n
    counts = torch.bincount(sample_rows(probs.expand(n, 4), seeds, positions), minlength=4).float()
    stat, df = chi_square(counts, probs)
    assert stat < chi_square_critical(df)


def test_a_skewed_wide_distribution_is_drawn_faithfully():
    """49152 tokens (the default pair's vocabulary), mass spread as a power law."""
    probs = 1.0 / torch.arange(1, 49153, dtype=torch.float32) ** 1.2
    probs /= probs.sum()
    n = 3000
    tokens = sample_rows(probs.expand(n, -1), list(range(n)), [0] * n)
    counts = torch.bincount(tokens, minlength=probs.shape[0]).float()
    stat, df = chi_square(counts, probs)
    assert stat < chi_square_critical(df)


def test_uniforms_are_uniform_and_streams_independent():
    n = 20000
    u = uniforms([3] * n, list(range(n)), Stream.ROUTER)[:, 0]
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    stat, df = chi_square(counts, torch.full((20,), 1 / 20))
    assert stat < chi_square_critical(df)
    other = uniforms([3] * n, list(range(n)), Stream.ACCEPT)[:, 0]
    corr = torch.corrcoef(torch.stack([u, other]))[0, 1]
    assert abs(float(corr)) < 4 / math.sqrt(n)
    # neighbouring seeds and positions are not correlated either
    shifted = uniforms([4] * n, list(range(n)), Stream.ROUTER)[:, 0]
    assert abs(float(torch.corrcoef(torch.stack([u, shifted]))[0, 1])) < 4 / math.sqrt(n)
    assert abs(float(torch.corrcoef(torch.stack([u[1:], u[:-1]]))[0, 1])) < 4 / math.sqrt(n)


def _lowbias32(x: int) -> int:
    """The hash, written out on Python integers (the reference the numpy version must match)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_counter_hash_matches_its_definition_on_python_integers():
    """A uniform is lowbias32 chained over (stream, position, seed's high and low words,
    index), its top 24 bits centred: the numpy hash must give exactly that, bit for bit,
    for any seed (negative, past 2^64) and position (past 2^32), at every width."""
    seeds = [0, 1, 3, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1, -1, -5, -(2**63), 2**70 + 3, 12345678901234]
    positions = [0, 1, 7, 2**32 - 1, 2**32 + 1, 2**33 + 5, 123, 4096, 99, 2**40, 5, 65535]
    for stream in Stream:
        base = _lowbias32(int(stream) + 0x9E3779B9)
        for width in (1, 3, 9):
            got = sampling.host_uniforms(seeds, positions, stream, width)
            assert got.dtype == np.float32 and got.shape == (len(seeds), width)
            for row, (seed, pos) in enumerate(zip(seeds, positions)):
                key = _lowbias32((pos & 0xFFFFFFFF) ^ base)
                key = _lowbias32(((seed >> 32) & 0xFFFFFFFF) ^ key)
                key = _lowbias32((seed & 0xFFFFFFFF) ^ key)
                for i in range(width):
                    bits = _lowbias32(key ^ _lowbias32((i * 0x9E3779B1) & 0xFFFFFFFF))
                    assert got[row, i] == np.float32(((bits >> 8) + 0.5) / 2**24), (stream, width, seed, pos, i)


def test_draws_are_a_pure_function_of_seed_position_and_stream():
    probs = torch.softmax(torch.randn(6, 100), -1)
    seeds, positions = [1, 2, 3, -5, 2**62, -(2**63)], [0, 9, 9, 4, 100000, 3]
    batched = sample_rows(probs, seeds, positions)
    alone = [sample(probs[i], seeds[i], positions[i]) for i in range(6)]
    assert batched.tolist() == alone
    again = sample_rows(probs.flip(0), seeds[::-1], positions[::-1]).flip(0)
    assert again.tolist() == alone
    assert sample_rows(probs, seeds, positions, Stream.REPLACE).tolist() != alone


def test_extreme_finite_parameters_give_proper_distributions():
    """Finite values at their extremes never give inf/NaN: a tiny temperature is greedy,
    a tiny top_p keeps the top token, a huge temperature is (nearly) uniform."""
    logits = torch.tensor([[3.0, 1.0, 2.0, -1.0]] * 4)
    params = [
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1.0, top_p=1e-300),
        SamplingParams(temperature=1e30),
        SamplingParams(temperature=5e-5, top_k=1),
    ]
    p = distributions(logits, params)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(4))
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0] and p[1].tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(p[2], torch.full((4,), 0.25))
    assert p[3].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-3).greedy
    # logits that are not finite: the row falls back to its finite argmax
    bad = distributions(torch.tensor([[float("nan"), 1.0, float("inf"), 0.0]]), [SamplingParams(temperature=1.0)])
    assert torch.isfinite(bad).all() and float(bad.sum()) == 1.0


def test_batched_rows_follow_their_own_parameters():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    params = [
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.5),
    ]
    p = distributions(logits, params)
    for i in range(3):
        torch.testing.assert_close(p[i], distribution(logits[i], params[i]))


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


def _assert_drawn_from(engine, reqs, marginals) -> list:
    """Run the draft-and-verify requests (in batches of 500) and check, by a chi-square test,
    that their tokens at positions 0 and 1 follow `marginals` (P(x1), P(x2))."""
    results = []
    for i in range(0, len(reqs), 500):
        results += engine.generate_many(reqs[i : i + 500])
    assert any(r.rollbacks for r in results) and any(0 in r.sources for r in results)
    for position, probs in enumerate(marginals):
        counts = torch.bincount(torch.tensor([r.token_ids[position] for r in results]), minlength=len(probs)).float()
        stat, df = chi_square(counts, probs)
        assert stat < chi_square_critical(df), (position, stat, df)
    return results


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
    _assert_drawn_from(engine, reqs, (p1, p2))


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


# -- logit_bias ----------------------------------------------------------------------------------
def _biased(bias: dict[int, float], **kw) -> SamplingParams:
    return SamplingParams(logit_bias=tuple(sorted(bias.items())), **kw)


def test_logit_bias_is_added_before_temperature_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    bias = {0: -100.0, 3: 1.5}
    shifted = logits + torch.tensor([-100.0, 0, 0, 1.5, 0])
    for kw in (dict(temperature=1.0), dict(temperature=0.5, top_k=2), dict(temperature=1.0, top_p=0.7), {}):
        got = distribution(logits, _biased(bias, **kw))
        torch.testing.assert_close(got, distribution(shifted, SamplingParams(**kw)))
    assert distribution(logits, _biased(bias))[3] == 1.0  # greedy: the argmax of the biased logits
    # a batch: each row its own bias, or none
    rows = [_biased(bias, temperature=1.0), SamplingParams(temperature=1.0), _biased({4: 3.0})]
    p = distributions(logits.expand(3, 5), rows)
    for i in range(3):
        torch.testing.assert_close(p[i], distribution(logits, rows[i]))
    tokens = draw(logits.expand(3, 5), [_biased({4: 100.0}), SamplingParams(), _biased({0: -100.0})], [1] * 3, [0] * 3)
    assert tokens.tolist() == [4, 0, 1]  # greedy rows with a bias take its argmax too


def test_each_rows_bias_table_is_its_own_past_the_caches_size(monkeypatch):
    """A bias's [2, N] table and a row's parameters are cached by the object's identity
    (sampling._ByIdentity): rows with equal but distinct biases, the same object twice, and
    more distinct biases than the cache holds each add their own entries."""
    monkeypatch.setattr(sampling._bias_table, "size", 8)
    monkeypatch.setattr(sampling._row, "size", 8)
    torch.manual_seed(0)
    v = 40
    logits = torch.randn(30, v)
    rows = [_biased({(3 * i + j) % v: float(j - i) for j in range(1 + i % 5)}, temperature=1.0) for i in range(28)]
    rows += [rows[0], _biased(dict(rows[0].logit_bias), temperature=1.0)]  # the same object; an equal one
    dense = torch.zeros(30, v)
    for i, p in enumerate(rows):
        for t, b in p.logit_bias:
            dense[i, t] += b
    for _ in range(2):  # the second pass reads the cache (or what is left of it)
        got = distributions(logits, rows)
        torch.testing.assert_close(got, distributions(logits + dense, [SamplingParams(temperature=1.0)] * 30))
    assert len(sampling._bias_table.entries) <= 8 and len(sampling._row.entries) <= 8


def test_biased_draws_follow_the_biased_distribution():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    params = _biased({0: -100.0, 3: 1.0}, temperature=1.0)
    n = 4000
    tokens = draw(logits.expand(n, 4), [params] * n, list(range(n)), [3] * n)
    counts = torch.bincount(tokens, minlength=4).float()
    expected = distribution(logits, params)
    assert counts[0] == 0
    stat, df = chi_square(counts, expected)
    assert stat < chi_square_critical(df)
    stat, df = chi_square(counts[1:], distribution(logits, SamplingParams(temperature=1.0))[1:] / 0.6)
    assert stat > chi_square_critical(df)  # the unbiased distribution's shape is told apart


def test_speculative_sampling_with_a_bias_matches_the_large_models_biased_distribution(soft_pair, tokenizer):
    """Exact verification compares the biased distributions of both models: the tokens follow M_L's
    biased distribution (a ban on its likeliest first token and a lift of another)."""
    small, large = soft_pair
    plain = SamplingParams(temperature=1.0, max_tokens=2)
    p1, _ = _large_marginals(large, PROMPT, plain)
    top = int(p1.argmax())
    lift = int(p1.argsort()[p1.shape[0] // 2])  # a middling token
    params = _biased({top: -100.0, lift: 2.0}, temperature=1.0, max_tokens=2)
    b1, b2 = _large_marginals(large, PROMPT, params)
    assert b1[top] < 1e-30 and b1[lift] > 2 * p1[lift]
    engine = engine_for(soft_pair, tokenizer)
    reqs = []
    for s in range(2000):
        r = request(PROMPT, 2, "draft", seed=s, temperature=1.0, draft_tokens=1, verification=Verification.EXACT)
        reqs.append(dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, logit_bias=params.logit_bias)))
    results = _assert_drawn_from(engine, reqs, (b1, b2))
    assert all(r.token_ids[0] != top for r in results)


@pytest.mark.parametrize(
    "routing", [dict(router="always-small"), dict(router="always-large"), dict(router="random", rate=0.5)]
)
def test_a_forcing_bias_makes_every_level_emit_the_token(pair, tokenizer, routing):
    engine = engine_for(pair, tokenizer)
    r = request(PROMPT, 8, seed=2, **routing)
    forced = dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, logit_bias=((7, 100.0),)))
    result = engine.generate(forced)
    assert result.token_ids == (7,) * 8
    assert engine.generate(r).token_ids != (7,) * 8  # not what it says unbiased
