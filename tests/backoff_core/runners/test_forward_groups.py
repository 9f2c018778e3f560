"""runners/dynamic.py: an extend whose sessions' caches differ much in length runs as a few
padded forwards (`forward_groups`), each row with the logits it gets alone."""

from __future__ import annotations

import inspect
import itertools
import random
import warnings

import pytest
import torch

from backoff_core.runners.dynamic import QUERY_ROW_POSITIONS, ModelRunner, forward_groups


def _cost(past: list[int], new: list[int], groups: list[list[int]], pad_cost: int) -> int:
    """pad_cost a forward, plus its padded cache positions and padded query rows."""
    total = 0
    for g in groups:
        p_max, k_max = max(past[i] for i in g), max(new[i] for i in g)
        total += pad_cost + sum(p_max - past[i] + QUERY_ROW_POSITIONS * (k_max - new[i]) for i in g)
    return total


def _least_cost(past: list[int], new: list[int], pad_cost: int) -> int:
    """Brute force: every split into runs of the rows ordered by size, longest first."""
    order = sorted(range(len(past)), key=lambda i: -(past[i] + QUERY_ROW_POSITIONS * new[i]))
    n, best = len(order), None
    for cuts in itertools.product((False, True), repeat=n - 1):
        groups, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                groups.append(order[start:i])
                start = i
        groups.append(order[start:n])
        cost = _cost(past, new, groups, pad_cost)
        best = cost if best is None else min(best, cost)
    return best


def test_similar_rows_stay_one_forward_in_row_order():
    assert forward_groups([60, 61, 58, 70, 64], [1, 2, 1, 1, 3], 2048) == [[0, 1, 2, 3, 4]]
    assert forward_groups([5], [1], 2048) == [[0]]
    # 7 x (2048 - 60) padded cache positions cost more than a forward: the long session alone
    assert forward_groups([60, 60, 60, 2048, 60, 60, 60, 60], [2] * 8, 2048) == [[3], [0, 1, 2, 4, 5, 6, 7]]
    # one short row beside long ones: padding it (~1000 positions) is cheaper than a forward
    assert forward_groups([1000, 1010, 5, 1020], [1, 1, 1, 1], 2048) == [[0, 1, 2, 3]]
    # a first catch-up over a whole prompt (2050 new tokens) beside decode catch-ups: alone
    assert forward_groups([60, 0, 61, 59], [2, 2050, 1, 3], 2048) == [[1], [0, 2, 3]]


@pytest.mark.parametrize("seed", range(40))
def test_groups_cover_every_row_once_at_least_cost(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 8)
    past = [rng.choice([rng.randint(0, 50), rng.randint(500, 3000)]) for _ in range(n)]
    new = [rng.choice([1, 2, rng.randint(1, 300)]) for _ in range(n)]
    pad_cost = rng.choice([256, 2048])
    groups = forward_groups(past, new, pad_cost)
    assert sorted(i for g in groups for i in g) == list(range(n))
    assert all(g == sorted(g) for g in groups)
    assert _cost(past, new, groups, pad_cost) == min(
        _least_cost(past, new, pad_cost), _cost(past, new, [list(range(n))], pad_cost)
    )


@pytest.mark.parametrize("last_only", [False, True])
def test_a_split_extend_gives_each_row_its_logits_alone(pair, last_only):
    """A session 40 positions long and three of 3 (a forward worth 64 padded positions):
    two forwards, the short rows padded to 3, not 40; every row's logits and hidden states as
    when it extends alone."""
    large = pair[1]
    split, alone = ModelRunner(large, "split"), ModelRunner(large, "alone")
    split.split_pad_positions = 64
    prompts = {"a": [3, 4, 5], "long": list(range(5, 45)), "b": [6, 7, 8], "c": [9, 10, 11]}
    for runner in (split, alone):
        for request_id, ids in prompts.items():
            runner.open(request_id)
            runner.extend([(request_id, ids)])
    pasts: list[int] = []
    forward = large.forward

    def counted(*args, **kwargs):
        pasts.append(kwargs[split._cache_kw].get_seq_length())
        return forward(*args, **kwargs)

    items = [("a", [12, 13]), ("long", [14]), ("b", [15, 16]), ("c", [17, 18])]
    large.forward = counted
    try:
        together = split.extend(items, hidden_layer=1, last_only=last_only)
    finally:
        del large.forward
    assert sorted(pasts) == [3, 40] and split.forward_passes == 4 + 2
    for item, ext in zip(items, together):
        (one,) = alone.extend([item], hidden_layer=1, last_only=last_only)
        torch.testing.assert_close(ext.logits, one.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ext.hidden, one.hidden, atol=1e-5, rtol=1e-5)
        assert split.length(item[0]) == alone.length(item[0]) == len(prompts[item[0]]) + len(item[1])


def test_the_cache_goes_under_this_transformers_name(pair):
    """The cache is passed under the keyword this transformers' forward declares (`cache`
    since 5.24, where `past_key_values` warns and goes in 5.40), alone and batched: no
    FutureWarning, the same logits."""
    large = pair[1]
    runner = ModelRunner(large, "named")
    assert runner._cache_kw in inspect.signature(large.forward).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for request_id, ids in {"a": [3, 4, 5], "b": list(range(5, 25))}.items():
            runner.open(request_id)
            runner.extend([(request_id, ids)])
        runner.extend([("a", [6, 7]), ("b", [8])], last_only=True)
    assert runner.forward_passes == 3
