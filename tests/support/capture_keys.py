"""The bucket kinds the runners capture and the inputs a capture writes first: what the
capture-safety checks run over, the eager forward's (tests/backoff_core/runners/
test_capture_safety.py) and the compiled one's (test_static_compiled.py)."""

from __future__ import annotations

import torch

from backoff_core.runners.cuda_graphs import CudaGraphs
from backoff_core.runners.graph_plan import K_BUCKETS, GraphKey, kinds, plan_keys

SLOTS, MAX_LEN, ROWS = 4, 64, 2


def bucket_kinds(num_layers: int) -> list[GraphKey]:
    """One key (ROWS rows, the first L bucket) per distinct kind x read path that the runners
    capture: factory.make_runner's M_S kinds (with a classifier layer in the middle and at
    the top) and M_L's (every kind, last_only both ways)."""
    small = kinds((None, 1, num_layers), (True,), (1, 2))
    large = kinds((None,), (True, False), K_BUCKETS)
    keys = plan_keys(SLOTS, MAX_LEN, SLOTS, list(dict.fromkeys(small + large)), budget=10**6)
    chosen = {(k.dense, k.k, k.last_only, k.hidden_layer): k for k in keys if k.rows == ROWS}
    return list(chosen.values())


def harmless_inputs(graphs: CudaGraphs, key: GraphKey) -> None:
    """What CudaGraphs.capture writes before a capture: every token at the scratch column."""
    graphs.positions.fill_(graphs.forward.kv.scratch)
    graphs.slots.copy_(torch.arange(graphs.max_rows) if key.dense else torch.zeros(graphs.max_rows))
    graphs.last_col.zero_()


KEYS = bucket_kinds(2)
