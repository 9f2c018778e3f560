"""StaticRunner.extend(on_device=...): one new id an item read from a device tensor (M_S's
step launched ahead, engine/ahead.py) gives the logits, hidden states and session lengths
that the same ids given on the host give, in every layout an M_S step takes (the dense view
in slot order, the dense view out of it, gathered rows), eagerly and replayed from the
(eager stand-in) graphs, where the ids go into the uploaded buffer before the replay."""

from __future__ import annotations

import pytest
import torch

from tests.support.eager_graphs import TOL, EagerGraphs, spy_layouts, static
from tests.support.tiny import tiny_model

SIDS = [f"s{i}" for i in range(6)]
PREFIXES = {"s0": [1, 2, 3], "s1": [4], "s2": [5, 6, 7, 8], "s3": [9, 10], "s4": [11], "s5": [12, 13, 14]}


def _pair(graphs: bool):
    """Two StaticRunners over one model with the same sessions and prefixes: one is given
    ids on the host, the other on the device."""
    model = tiny_model(1)
    runners = []
    for _ in range(2):
        run = static(model, slots=8, max_len=64)
        for request_id in SIDS:
            run.open(request_id)
        run.extend(list(PREFIXES.items()))
        if graphs:
            run.graphs = EagerGraphs(run._forward, max_rows=8, max_k=16)
            run.warmup(hidden_layers=(None, 1), last_only=(True,), ks=(1,), progress=False)
        runners.append(run)
    return runners


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize(
    "sids, layout",
    [
        (SIDS, (True, 8, 1)),  # every slot, in slot order: the dense view, in order
        (["s5", "s0", "s3", "s1", "s4", "s2"], (True, 8, 1)),  # the dense view, out of order
        (["s4", "s1"], (False, 2, 1)),  # two of eight slots: gathered rows
    ],
)
@pytest.mark.parametrize("hidden_layer", [None, 1])
def test_ids_on_the_device_equal_the_same_ids_on_the_host(graphs, sids, layout, hidden_layer):
    host, device = _pair(graphs)
    seen = spy_layouts(device)
    ids = [20 + i for i in range(len(sids))]
    want = host.extend([(s, [i]) for s, i in zip(sids, ids)], hidden_layer=hidden_layer, last_only=True)
    replays = device.eager_passes
    got = device.extend(
        [(s, [0]) for s in sids], hidden_layer=hidden_layer, last_only=True, on_device=torch.tensor(ids)
    )
    assert seen == [layout]
    assert device.eager_passes - replays == (0 if graphs else 1)  # a graph's replay, where captured
    for w, g in zip(want, got):
        torch.testing.assert_close(g.logits, w.logits, **TOL)
        if hidden_layer is not None:
            torch.testing.assert_close(g.hidden, w.hidden, **TOL)
    assert [device.length(s) for s in SIDS] == [host.length(s) for s in SIDS]
    # the next step reads the keys the device ids wrote
    after = [(s, [30]) for s in sids]
    for w, g in zip(host.extend(after, last_only=True), device.extend(after, last_only=True)):
        torch.testing.assert_close(g.logits, w.logits, **TOL)


def test_ids_on_the_device_take_one_id_an_item():
    run, _ = _pair(False)
    with pytest.raises(ValueError, match="one new id an item"):
        run.extend([("s0", [1, 2])], on_device=torch.tensor([1]))
