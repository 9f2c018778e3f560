"""One way to the host: during a step, every device-to-host read goes through
engine/host.py's `to_host`, once per stage (M_S's tokens with the routers' scores; each
catch-up level; the logprobs asked for), whatever the batch size.

On the CPU a device read cannot be told from a host one, so the check is stricter than
the GPU needs: while `step()` runs, no tensor is read back at all except inside host.py.
Two nets catch a read elsewhere: the Python ways of reading a tensor (`tolist`, `item`,
`bool`, `float`, `int`, `cpu`, `numpy`, ...) are wrapped, and a dispatch mode records the
ops that sync on a GPU (`_local_scalar_dense`, which every scalar read lowers to, and the
ops whose output size depends on values, such as `nonzero` and boolean indexing)."""

from __future__ import annotations

import collections
import sys
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backoff_core import sampling
from backoff_core.engine import commit as commit_module
from backoff_core.engine import engine as engine_module
from backoff_core.engine import host
from backoff_core.engine.engine import BackoffEngine
from backoff_core.routing.routers import build_router
from backoff_core.runners.factory import make_runner
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams, Verification

READS = ("tolist", "item", "__bool__", "__float__", "__int__", "__index__", "__complex__", "cpu", "numpy", "__array__")
# ops that wait for the device on a GPU: a scalar read, or an output whose size depends on values
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "equal"}
SYNCING_OVERLOADS = {"repeat_interleave.Tensor", "is_nonzero.default"}
# the one numpy view of a tensor allowed outside host.py: sampling.argmax_last on a CPU tensor
# (test_argmax_last_stays_on_a_non_cpu_device shows the branch is never taken elsewhere)
CPU_ONLY = (sampling.__file__, "argmax_last")


class _Syncs(TorchDispatchMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])
        if name in SYNCING or str(func).removeprefix("aten.") in SYNCING_OVERLOADS or bool_index:
            self.found.append(f"{func} at {_where()}")
        return func(*args, **(kwargs or {}))


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "backoff_core" in f.filename or "transformers" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


class HostReads:
    """Counts the copies `to_host` makes during each step and lists every other read."""

    def __init__(self, engine: BackoffEngine, monkeypatch) -> None:
        self.engine, self.monkeypatch = engine, monkeypatch
        self.elsewhere: list[str] = []
        self.reads: list[int] = []  # to_host copies per step
        self.stages: list[int] = []  # stages that had something to read, per step
        self._active = False
        self._reads = self._stages = 0
        for name in READS:
            if hasattr(torch.Tensor, name):
                monkeypatch.setattr(torch.Tensor, name, self._watch(name, getattr(torch.Tensor, name)))
        # a stage: propose with requests, a catch-up with requests, logprobs asked for
        monkeypatch.setattr(engine_module, "propose", self._stage(engine_module.propose, lambda a: a[1]))
        monkeypatch.setattr(engine.catch_up, "run", self._stage(engine.catch_up.run, lambda a: a[1]))
        monkeypatch.setattr(commit_module, "logprob_values", self._stage(commit_module.logprob_values, lambda a: a[0]))

    def _watch(self, name, method):
        def watched(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if self._active and (caller.co_filename, caller.co_name) == CPU_ONLY and tensor.device.type == "cpu":
                pass  # numpy's argmax over a CPU tensor: host memory already (a GPU tensor takes torch's)
            elif self._active and caller.co_filename != host.__file__:
                self.elsewhere.append(f"Tensor.{name} at {_where()}")
            elif self._active:
                self._reads += 1  # to_host's one copy
            return method(tensor, *args, **kwargs)

        return watched

    def _stage(self, fn, items):
        def staged(*args, **kwargs):
            self._stages += bool(items(args))
            return fn(*args, **kwargs)

        return staged

    def run(self) -> None:
        while self.engine.has_work():
            self._reads = self._stages = 0
            self._active = True
            with _Syncs(self.elsewhere):
                self.engine.step()
            self._active = False
            self.reads.append(self._reads)
            self.stages.append(self._stages)


def _engine(models, tokenizer, static: bool, **kwargs) -> BackoffEngine:
    kv = KVSpec(budget_tokens=64 * 64, max_len=64) if static else None
    names = ["small", *[f"medium{i}" for i in range(1, len(models) - 1)], "large"]
    runners = [make_runner(m, n, kv, small=i == 0) for i, (m, n) in enumerate(zip(models, names))]
    return BackoffEngine(runners, tokenizer, **kwargs)


SCENARIOS = {
    # name: (static KV, chain of 3, engine kwargs, sampling, routing). Static KV is the GPU
    # path; per-session caches run HF's own forward, whose mask helpers read tensors
    # (transformers/masking_utils.py), so the check leaves the model forward out there.
    "always-small": (True, False, {}, {}, dict(router="always-small")),
    "random, sampled": (True, False, {}, dict(temperature=0.8, top_p=0.9, top_k=20), dict(router="random", rate=0.6)),
    "entropy, logprobs, stop": (True, False, {}, dict(logprobs=2, stop=("w7 w7",)), dict(router="entropy")),
    "oracle, KL recorded": (True, False, dict(collect_kl=True), {}, dict(router="oracle")),
    "draft, exact": (True, False, {}, dict(temperature=1.0), dict(router="draft", verification=Verification.EXACT)),
    "draft, KL": (
        True,
        False,
        {},
        dict(temperature=0.7),
        dict(router="draft", verification=Verification.KL, tolerance=0.5),
    ),
    "three levels": (True, True, {}, dict(temperature=1.0, logprobs=0), dict(router="random", thresholds=(0.4, 0.7))),
    "classifier": (True, False, dict(hidden_size=32), {}, dict(router="classifier")),
    # M_S's step launched ahead (ahead.py): the launch reads nothing back, the step's read is one
    "always-small, launched ahead": (True, False, dict(launch_ahead=True), {}, dict(router="always-small")),
    "random, launched ahead": (
        True,
        False,
        dict(launch_ahead=True),
        dict(temperature=0.8),
        dict(router="random", rate=0.6),
    ),
    "classifier, launched ahead": (True, False, dict(hidden_size=32, launch_ahead=True), {}, dict(router="classifier")),
    "penalties, draft, exact": (  # counts on the device (penalties.py), rollbacks and earlier positions
        True,
        False,
        {},
        dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
        dict(router="draft", verification=Verification.EXACT),
    ),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_one_host_read_per_stage_at_1_and_at_64_requests(scenario, pair, chain3, tokenizer, monkeypatch):
    static, three, kwargs, sampling, routing = SCENARIOS[scenario]
    per_step = {}
    for n in (1, 64):
        engine = _engine(chain3 if three else pair, tokenizer, static, **kwargs)
        router = build_router("classifier", hidden_size=32) if routing["router"] == "classifier" else None
        for i in range(n):
            params = SamplingParams(max_tokens=10, seed=i, ignore_eos=True, **sampling)
            engine.submit(GenerationRequest((3, 4 + i % 7, 5, 6), params, RoutingParams(**routing)), router)
        counter = HostReads(engine, monkeypatch)
        counter.run()
        assert not counter.elsewhere, f"reads outside host.to_host at n={n}: {collections.Counter(counter.elsewhere)}"
        assert counter.reads == counter.stages, f"n={n}: reads {counter.reads} != stages {counter.stages}"
        levels = 3 if three else 2
        # M_S's tokens + scores, an oracle's catch-up, one per other level, the logprobs
        assert max(counter.reads) <= 1 + (levels - 1) + (scenario.startswith("oracle")) + ("logprobs" in sampling)
        assert min(counter.reads) >= 1
        per_step[n] = counter.reads
        for request_id in engine.finished_ids():
            engine.finish(request_id)
        monkeypatch.undo()
    if scenario.startswith("always-small"):
        assert per_step[1] == per_step[64] == [1] * 10  # the same at 1 and at 64 requests


def test_to_host_reads_every_part_exactly_in_one_copy(monkeypatch):
    copies = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: copies.append(t.dtype) or tolist(t))
    big = 2**60 + 1  # beyond float64's 2^53: exact only when no float part rides along
    ids = torch.tensor([3, big, 7])
    assert host.to_host(ids) == [[3, big, 7]] and copies == [torch.int64]
    mixed = host.to_host(
        torch.tensor([5, 6]), torch.tensor([0.25, -1.5], dtype=torch.float32), torch.tensor([True, False])
    )
    assert mixed == [[5, 6], [0.25, -1.5], [1, 0]] and copies[-1] == torch.float64
    assert all(type(v) is int for v in mixed[0] + mixed[2]) and all(type(v) is float for v in mixed[1])
    grid = host.to_host(torch.arange(6).reshape(2, 3), torch.tensor(2.5))  # 2-D nested, 0-D a list of one
    assert grid == [[[0, 1, 2], [3, 4, 5]], [2.5]] and len(copies) == 3
    assert host.to_host(torch.zeros(0), torch.zeros(0, dtype=torch.long)) == [[], []] and len(copies) == 3  # no copy
    with pytest.raises(ValueError, match="at most 2 dimensions"):
        host.to_host(torch.zeros(1, 1, 1))
