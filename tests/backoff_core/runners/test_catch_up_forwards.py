"""One forward per catch-up at any length up to the slot (issue 52, item 4: no cliff at 17
tokens, where an older engine ran a second forward). M_L as the GPU stages size it (64 slots x
1024 positions: graph_max_rows 64), its graph plan captured as factory.make_runner's warmup
captures it, the graphs' bookkeeping replayed eagerly (EagerGraphs), on each path a catch-up
takes: padded (ragged off: blocks of up to 16 over up to 64 gathered rows), `auto` (the CUDA
default: ragged graphs beside the padded ones, which displace the k = 16 last-logits kind) and
ragged on. A catch-up of k new tokens, k = 1, 16, 17, 33, 128 and the rest of the slot, is one
forward, and a replay (no eager pass). (The engine feeds a catch-up of more than its
prefill_chunk_tokens, 128, over steps, chunked.py, so that the other streams keep stepping.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backoff_core.runners.dynamic import ModelRunner
from backoff_core.runners.graph_plan import K_BUCKETS, GraphKey
from backoff_core.runners.static import StaticRunner
from backoff_core.runners.static_ragged import RaggedKey
from tests.support.eager_graphs import EagerGraphs
from tests.support.tiny import tiny_model

SLOTS, MAX_LEN = 64, 1024  # gpu_bench.sh's --kv-budget 65536 --max-len 1024
PROMPT = [(7 * i) % 40 + 1 for i in range(24)]
ROOM = MAX_LEN - 1 - len(PROMPT)  # what the slot holds past the prompt (its last column is scratch)
KS = (1, 16, 17, 33, 128, ROOM)


class PlannedGraphs(EagerGraphs):
    """EagerGraphs whose captures skip the warm-up run of their body (~200 of them at these
    sizes); a replay still runs it. Every replay is recorded by its key."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replayed: list[GraphKey | RaggedKey] = []

    def _record(self, key):
        def replay():
            self.replayed.append(key)
            self._body(key)

        return SimpleNamespace(replay=replay)


@pytest.fixture(scope="module")
def model():
    model = tiny_model(3, hidden=32, layers=2)
    model.config.max_position_embeddings = MAX_LEN
    return model


def large(model, ragged: str) -> StaticRunner:
    """M_L as make_runner builds it for KVSpec.ragged `ragged`, its plan captured (warmup). Its
    ragged forward is made cheap, all zeros (eager FlexAttention on the CPU materialises every
    score: 1024 x 64K of them at the slot's end), and warm-up's check of its logits against the
    padded path's taken as passed: test_static_ragged holds both."""
    run = StaticRunner(
        model,
        "large",
        kv_budget_tokens=SLOTS * MAX_LEN,
        max_len=MAX_LEN,
        evict_idle=True,
        ragged=ragged != "off",
        ragged_if_faster=ragged == "auto",
    )
    run.graphs = PlannedGraphs(run._forward, run.graph_max_rows, K_BUCKETS[-1])
    if run.ragged:
        run._forward.ragged = lambda batch: torch.zeros(run.graph_max_rows, run.vocab_size)
        run.ragged_rel_err = lambda prompt_ids=None: 0.0
    run.warmup(progress=False)
    assert run.graph_max_rows == 64 and run.ragged == (ragged != "off")  # warm-up's ragged check passed
    return run


def forwards_of(run: StaticRunner, k: int, ref: ModelRunner | None = None) -> list:
    """The forwards a catch-up of k tokens after PROMPT ran (the keys replayed; an eager pass
    as "eager"), its logits checked against ModelRunner's where `ref` is given; cropped back."""
    ids = [(5 * i) % 43 + 2 for i in range(k)]
    replayed, eager, passes = len(run.graphs.replayed), run.eager_passes, run.forward_passes
    (got,) = run.extend([("a", ids)], last_only=True)
    ran = run.graphs.replayed[replayed:] + ["eager"] * (run.eager_passes - eager)
    assert run.forward_passes - passes == len(ran)
    if ref is not None:
        (want,) = ref.extend([("a", ids)], last_only=True)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        ref.crop("a", len(PROMPT))
    run.crop("a", len(PROMPT))
    return ran


def opened(run: StaticRunner, ref: ModelRunner | None = None) -> None:
    for runner in (run, ref) if ref is not None else (run,):
        runner.open("a")
        runner.extend([("a", PROMPT)])


def test_a_padded_catch_up_is_one_replay_at_any_length_up_to_the_slot(model):
    """Ragged off (the padded plan, 196 graphs): blocks of 16 over gathered rows, up to 64 of
    them: the slot's 999 tokens past the prompt fill 63 rows, in the graph of 64; the logits
    are HF's (ModelRunner's) at every length."""
    run, ref = large(model, "off"), ModelRunner(model, "ref")
    assert len(run.graphs) == 196
    opened(run, ref)
    ran = {k: forwards_of(run, k, ref) for k in KS}
    assert all(len(keys) == 1 and keys[0] != "eager" for keys in ran.values()), ran
    assert ran[17][0].k == ran[16][0].k == 16 and ran[17][0].rows == 2  # 17: two blocks, one forward
    assert ran[ROOM][0] == GraphKey(False, 64, 16, 1024, True, None)


@pytest.mark.parametrize("ragged", ["auto", "on"])
def test_a_catch_up_is_one_forward_where_ragged_graphs_are_captured(model, ragged):
    """`auto` (M_L's default on CUDA): the ragged graphs displace the k = 16 last-logits kind, so
    past 64 blocks of 8 (512 tokens) no padded layout holds a catch-up in one forward; the ragged
    forward takes it, as it takes whatever its replay was timed faster at. "on": ragged wherever
    it applies. Either way one replay at every length."""
    run = large(model, ragged)
    assert not any(isinstance(key, GraphKey) and key.k == 16 and key.last_only for key in run.graphs._graphs)
    assert {key for key in run.graphs._graphs if isinstance(key, RaggedKey)} >= {RaggedKey(1024)}
    opened(run)
    ran = {k: forwards_of(run, k) for k in KS}
    assert all(len(keys) == 1 and keys[0] != "eager" for keys in ran.values()), ran
    assert ran[ROOM] == [RaggedKey(1024)] and ran[1] == [GraphKey(True, 1, 1, 256, True, None)]
    if ragged == "on":
        assert [ran[k][0] for k in (16, 17, 33, 128)] == [RaggedKey(32), RaggedKey(32), RaggedKey(64), RaggedKey(128)]
