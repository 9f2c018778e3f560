"""Blocks: an extend's new ids cut into rows of k, several rows to an item, in one forward
(static_layout.lay_out_blocks), and the layout chosen by the replay times the runner measured
at load (static_layout.choose, StaticRunner.warmup): exact bookkeeping on hand-written items,
the choice at the H100's measured costs, and ModelRunner's outputs whatever the layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backoff_core.runners.cuda_graphs import CudaGraphs
from backoff_core.runners.graph_plan import K_BUCKETS, GraphKey
from backoff_core.runners.static_layout import choose, lay_out_blocks
from tests.support.eager_graphs import EagerGraphs, NoTimeEvent, assert_same, both, spy_layouts, static
from tests.support.gpu_runs import RUN3
from tests.support.tiny import tiny_model

SCRATCH = 255
ANATOMY = RUN3 / "catch_up_anatomy.json"


def test_blocks_lay_out_each_item_on_consecutive_rows():
    # three items: 5 new ids at position 10 of slot 3, 1 at 4 of slot 0, 3 at 7 of slot 6
    held, slot, counts = np.array([10, 4, 7]), np.array([3, 0, 6]), np.array([5, 1, 3])
    new = np.array([11, 12, 13, 14, 15, 21, 31, 32, 33])
    plan = lay_out_blocks(
        held, slot, new, counts, k=2, length_buckets=(64, 256), scratch=SCRATCH, layer=None, last_only=True
    )
    assert plan.key == GraphKey(False, 8, 2, 64, True, None)  # 3 + 1 + 2 = 6 blocks -> 8 rows
    assert plan.first.tolist() == [0, 3, 4] and plan.rows.tolist() == [2, 3, 5]
    assert plan.input_ids.tolist() == [[11, 12], [13, 14], [15, 0], [21, 0], [31, 32], [33, 0], [0, 0], [0, 0]]
    s = SCRATCH
    assert plan.positions.tolist() == [[10, 11], [12, 13], [14, s], [4, s], [7, 8], [9, s], [s, s], [s, s]]
    assert plan.slots.tolist() == [3, 3, 3, 0, 6, 6, 0, 0]  # padding rows read slot 0's scratch
    assert plan.last_col.tolist() == [1, 1, 0, 0, 1, 0, 0, 0]


def h100_costs() -> dict[GraphKey, float]:
    """The 8B M_L's replay times measured on the H100 (catch_up_anatomy.json's grid)."""
    grid = json.loads(ANATOMY.read_text())["grid"]
    return {GraphKey(g["dense"], g["rows"], g["k"], g["L"], True, None): g["ms"] for g in grid}


def choice(counts, slots, cost, max_forwards=8):
    """At most 32 rows a forward: the largest gathered batch that run measured."""
    counts, slot = np.array(counts), np.array(slots)
    return choose(
        np.full(len(counts), 50),
        slot,
        counts,
        ks=K_BUCKETS,
        cost=cost,
        length_buckets=(256, 1024),
        num_slots=64,
        max_rows=32,
        max_forwards=max_forwards,
        layer=None,
        last_only=True,
    )


@pytest.mark.parametrize(
    ("counts", "slots", "want"),
    [
        # 20 catch-ups spread over 64 slots, 2 to 40 pending each: 28 blocks of 16 in one
        # forward (32 gathered rows, 17.8 ms), where chunks of 16 took three (20, 6 and 2
        # rows: 17.8 + 10.3 + 8.6 ms) and blocks of 8 two (32 + 10 rows: 13.6 + 10.9 ms)
        ([2, 3, 5, 7, 9, 11, 14, 17, 20, 40] * 2, list(range(0, 60, 3)), (16, False, 1)),
        ([1] * 32, list(range(32)), (1, True, 1)),  # a step of every slot: the dense view
        ([3] * 4, [0, 1, 2, 3], (4, True, 1)),  # four rows at k 4: the dense view of 4
        ([30], [5], (16, False, 1)),  # one long catch-up: 2 blocks of 16, one forward
        ([16 * 32] * 2, [0, 1], (16, False, 2)),  # 32 blocks each: a forward each
    ],
)
def test_the_measured_fastest_layout_is_chosen(counts, slots, want):
    layout = choice(counts, slots, h100_costs().get)
    assert (layout.k, layout.dense, len(layout.groups)) == want


def test_no_layout_past_the_forwards_allowed_or_without_graphs():
    costs = h100_costs()
    assert choice([16 * 32 + 1], [0], costs.get) is None  # one item past 32 blocks of 16
    assert choice([16 * 32] * 9, list(range(9)), costs.get) is None  # 9 forwards > 8
    assert choice([16 * 32] * 3, list(range(3)), costs.get, max_forwards=2) is None
    assert choice([5, 2], [0, 1], {}.get) is None  # nothing captured


def test_a_layout_costs_the_sum_of_its_forwards():
    costs = h100_costs()
    layout = choice([16 * 32, 3], [0, 1], costs.get)  # 32 + 1 blocks: two forwards
    assert layout.k == 16 and [(g.start, g.stop) for g in layout.groups] == [(0, 1), (1, 2)]
    # the first reads 50 + 512 keys (L 1024); the second holds one block of 3 tokens
    first, second = GraphKey(False, 32, 16, 1024, True, None), GraphKey(False, 1, 16, 256, True, None)
    assert layout.cost == pytest.approx(costs[first] + costs[second])


def test_warmup_times_every_graph_and_extends_follow_the_times():
    model = tiny_model(2, hidden=64, layers=4, sharpness=30)
    sids = [f"s{i}" for i in range(8)]
    ref, run = both(model, sids)
    for i, request_id in enumerate(sids):  # slot i each, different lengths
        assert_same(ref, run, [(request_id, list(range(1, 3 + 2 * i)))])
    # a device where every forward costs 8 and each token slot 1 / 64 (EagerGraphs' default)
    run.graphs = EagerGraphs(run._forward, max_rows=8, max_k=16)
    graphs, _ = run.warmup(hidden_layers=(None, 1), progress=False)
    assert set(run.graphs.ms) == set(run.graphs._graphs) and len(run.graphs.ms) == graphs
    seen = spy_layouts(run)
    spread = ["s0", "s2", "s5", "s7"]
    cases = [
        # 6 each: one row each, gathered (4 x 8: 32 slots, in fewer rows than 8 blocks of 4)
        ([(s, [3] * 6) for s in spread], dict(last_only=True), [(False, 4, 8)]),
        # 1, 2, 9, 20: 1 + 1 + 2 + 3 blocks of 8 (64 slots), not 16s (8 x 16) nor two forwards of 4s
        ([(s, [4] * c) for s, c in zip(spread, (1, 2, 9, 20))], {}, [(False, 8, 8)]),
        # 12 blocks of 8 in two forwards (8 + 4 rows: 17.5), not 10 of 16 (8 + 2 rows: 18.5)
        (
            [(s, [5] * c) for s, c in zip(sids, (3, 1, 2, 40, 7, 4, 2, 5))],
            dict(hidden_layer=1),
            [(False, 8, 8), (False, 4, 8)],
        ),
        ([(s, [6] * 30) for s in sids], dict(last_only=True), [(False, 8, 16)] * 2),  # 16 blocks of 16
        ([(s, [7]) for s in spread], dict(last_only=True), [(True, 8, 1)]),  # one token each: the view
    ]
    for items, kwargs, layouts in cases:
        del seen[:]
        assert_same(ref, run, items, **kwargs)
        assert seen == layouts, items
    assert run.eager_passes == 8  # the prefills before the capture only


def test_replays_are_timed_on_the_inputs_their_graphs_were_captured_on(monkeypatch):
    # 6 slots: gathered forwards of up to 8 rows (the next power of two), dense views of up to 4.
    # A dense capture leaves its rows' slot ids 0..7 in the buffer; a gathered graph timed on
    # them would gather slots 6 and 7, past the storage (on a GPU: a device-side assert at load)
    model = tiny_model(2, hidden=64, layers=2)
    run = static(model, slots=6)
    run.graphs = EagerGraphs(run._forward, run.graph_max_rows, max_k=2)
    run.graphs.capture([GraphKey(True, 4, 1, 128, True, None), GraphKey(False, 8, 1, 128, True, None)], progress=False)
    monkeypatch.setattr(torch.cuda, "Event", NoTimeEvent)
    for key in sorted(run.graphs._graphs, key=lambda k: not k.dense):  # the dense one first, as a capture may end
        assert CudaGraphs.replay_ms(run.graphs, key) == 1.0  # the real replay_ms, the body run eagerly
        assert run.graphs.slots.max() < (run.kv.slots if not key.dense else run.graphs.max_rows)
