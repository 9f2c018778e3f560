"""Dense view or gathered rows, chosen by the replay times the runner measured at load
(StaticRunner._measure_layouts, static_layout.lay_out's gather_over): the choice follows the
costs, and either way the outputs are ModelRunner's."""

from __future__ import annotations

import pytest

from backoff_core.runners.graph_plan import GraphKey
from backoff_core.runners.static_layout import lay_out
from tests.backoff_core.runners.test_static import assert_same, both
from tests.support.eager_graphs import EagerGraphs
from tests.support.tiny import tiny_model


def plan(slots, k, gather_over=()):
    return lay_out(
        [5] * len(slots),
        slots,
        [[1] * k for _ in slots],
        ks=(1, 2, 4, 8, 16),
        length_buckets=(256,),
        num_slots=64,
        scratch=255,
        layer=None,
        last_only=True,
        gather_over=gather_over,
    )


@pytest.mark.parametrize(
    ("n", "k", "gather_over", "dense", "rows"),
    [
        (32, 16, (), True, 64),  # half the view's rows: the view, by default
        (32, 16, {(16, 64)}, False, 32),  # ... gathered where that was measured faster
        (32, 3, {(16, 64)}, True, 64),  # k bucket 4: not where gathering won
        (33, 16, {(16, 64)}, True, 64),  # 33 gathered rows would be 64: no gain, the view
        (16, 16, (), False, 16),  # a quarter: gathered by the dense rule already
    ],
)
def test_half_a_view_gathers_where_it_was_measured_faster(n, k, gather_over, dense, rows):
    slots = [63] + list(range(n - 1))  # the highest slot makes the view 64 rows
    p = plan(slots, k, gather_over)
    assert (p.key.dense, p.key.rows) == (dense, rows)
    assert sorted(p.slots[p.rows].tolist()) == sorted(slots)  # every item in its own slot's row
    assert (p.positions[p.rows, : min(k, p.key.k)] == 5 + p.positions.new_tensor(range(min(k, p.key.k)))).all()


def copy_costs(key: GraphKey) -> float:
    """A device where a row-token costs 1 and gathering a row's keys 6: halving the rows pays
    from k = 8 on (r k against r k / 2 + 3 r)."""
    return key.rows * key.k + (0 if key.dense else 6 * key.rows)


def spy_layouts(run) -> list[tuple[bool, int, int]]:
    seen, inner = [], run._run

    def spy(plan, columns=None):
        seen.append((plan.key.dense, plan.key.rows, plan.key.k))
        return inner(plan, columns)

    run._run = spy
    return seen


def test_the_runner_measures_the_pairs_and_gathers_where_it_pays():
    model = tiny_model(2, hidden=64, layers=4, sharpness=30)
    sids = [f"s{i}" for i in range(8)]
    ref, run = both(model, sids)
    for i, request_id in enumerate(sids):  # slot i each, different lengths
        assert_same(ref, run, [(request_id, list(range(1, 3 + 2 * i)))])
    run.graphs = EagerGraphs(run._forward, max_rows=8, max_k=16, cost=copy_costs)
    run.warmup(progress=False)
    # every dense batch of k >= 2 against the gathered half, once each, at the longest L
    assert {(t.dense, t.rows, t.k) for t in run.graphs.timed} == {
        (dense, r if dense else r // 2, k) for dense in (True, False) for r in (2, 4, 8) for k in (2, 4, 8, 16)
    }
    assert all(t.length == max(run.length_buckets) for t in run.graphs.timed)
    pays = {(k, r) for k in (8, 16) for r in (2, 4, 8)}
    assert run._gather_over == {(True, None): pays, (False, None): pays}

    seen = spy_layouts(run)
    spread = ["s0", "s2", "s5", "s7"]  # 4 of an 8-row view
    assert_same(ref, run, [(s, [3] * 6) for s in spread], last_only=True)  # k 8: gathered
    assert_same(ref, run, [(s, [4] * 3) for s in spread])  # k 4: the view
    assert_same(ref, run, [(s, [5] * 12) for s in spread])  # full logits, k 16: gathered
    assert_same(ref, run, [(s, [6]) for s in spread], last_only=True)  # one token: the view
    assert seen == [(False, 4, 8), (True, 8, 4), (False, 4, 16), (True, 8, 1)]
    assert run.eager_passes == 8  # the prefills before the capture only
