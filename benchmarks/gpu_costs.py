"""What one GPU run measured, as the cost table of benchmarks/gpu_sim.py: M_L's graph replays
by bucket, M_S's step by rows, eager forwards, and a step's host work (fitted to that run).

Read from the run's files (`GpuCosts.from_results`): gpu_check.json's `replay_ms` of every
captured graph where the run saved it, else catch_up_anatomy.json's M_L grid and
gpu_check.json's M_S step anatomy. Buckets the run did not measure are estimated
(`GpuCosts.large_ms`, `GpuCosts.small_ms`). The eager forwards' costs are gpu_check.json's
`probes` where the run has them (runs since 2026-11-26), else the estimates of the H100's
third run (an eager M_L forward of 16x74 in catch_up_anatomy.json took ~65 ms beyond its
graph's compute; M_S's was never timed and is taken as the same). How M_S's steps and M_L's
forwards slow each other side by side on one GPU: gpu_check.json's `sharing` probe, where the
run has it (`GpuCosts.sharing`, the two streams of one priority as the engine's flights run by
default; gpu_sim --what-if shared), and with either side's stream first (`sharing_first`,
ThreadLauncher.first; gpu_sim_sharing.py reads them all). A step's host work: fitted to the
run's step_timeline.json where it has one (`fit_host`: the time beyond the forwards per step,
per request stepped and per catch-up, from always-small at n = 1 and at the most streams and
always-large at the most), else the constants priced from CPU figures (0.25 ms, 7 us a
request, 0.35 ms a catch-up), which the fourth H100 run found short: 0.87 ms a step of 64
requests against 0.70, 1.25 ms a catch-up against 0.35.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from backoff_core.runners.graph_plan import GraphKey
from backoff_core.runners.static_ragged import RaggedKey

GPU_RESULTS = Path("benchmarks/results/gpu")


@dataclass(frozen=True)
class GpuCosts:
    """What one GPU run measured, in ms: M_L graph replays by bucket, M_S's step by rows,
    eager forwards, and the host's share of a step."""

    large: dict[tuple[bool, int, int, int], float]  # (dense, rows, k, L) -> replay ms (last logits)
    small_rows: dict[int, float]  # rows -> M_S replay ms (k = 1)
    large_eager_ms: float  # what an eager M_L forward adds to its compute (launches, mask, Python)
    small_eager_ms: float  # an eager M_S forward (its prompt prefill)
    host_ms: float  # a step's host work beside its forwards: fixed part ...
    host_ms_per_row: float  # ... and per request stepped
    host_ms_per_catch_up: float  # ... and per catch-up forward (layout, upload, read back)
    source: str = ""
    small_k: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, k > 2) -> M_S replay ms
    sharing: tuple[float, float] | None = None  # M_S's and M_L's slowdowns side by side on one GPU (probe)
    # the same with "loop" or "flight" scheduled first (ThreadLauncher.first), where measured
    sharing_first: dict[str, tuple[float, float]] = field(default_factory=dict)
    ragged: dict[int, float] = field(default_factory=dict)  # tokens -> M_L ragged replay ms (gpu_check `ragged`)
    gpu: str = ""  # the GPU the run measured on (gpu_check.json's "gpu")

    def large_ms(self, key: GraphKey | RaggedKey, real: int, eager: bool) -> float:
        """A replay's measured time. Buckets the grid lacks: a gathered batch of more rows than
        it measured gathered, at its dense view's time plus the gathering's cost scaled by rows
        (gathered - dense, at the largest rows measured both ways, same k and L); anything
        else (full logits, other k) at the measured bucket of the same L with the nearest
        token slots, rows x k. A ragged forward (static_ragged.py): its measured replay where the
        run has one (gpu_check's `ragged` probe), else `ragged_ms`."""
        if isinstance(key, RaggedKey):
            return self.ragged.get(key.tokens) or self.ragged_ms(key.tokens)
        ms = self.large.get((key.dense, key.rows, key.k, key.length))
        if ms is None and not key.dense and (True, key.rows, key.k, key.length) in self.large:
            measured = [r for d, r, k, n in self.large if not d and k == key.k and n == key.length]
            r = max(measured, default=0)
            if r and (True, r, key.k, key.length) in self.large:
                gathering = self.large[(False, r, key.k, key.length)] - self.large[(True, r, key.k, key.length)]
                ms = self.large[(True, key.rows, key.k, key.length)] + max(0.0, gathering) * key.rows / r
        if ms is None:
            same_l = [(d, r, k) for d, r, k, n in self.large if n == key.length] or [
                (d, r, k) for d, r, k, _ in self.large
            ]
            d, r, k = min(same_l, key=lambda c: (abs(c[1] * c[2] - key.rows * key.k), c[0] != key.dense, c[1]))
            lengths = sorted({n for *_, n in self.large})
            n = lengths[min(bisect.bisect_left(lengths, key.length), len(lengths) - 1)]
            ms = self.large.get((d, r, k, n)) or self.large[min(self.large, key=lambda c: abs(c[1] * c[2] - r * k))]
            ms *= max(1.0, key.rows * key.k / (r * k)) ** 0.9  # compute-bound past the grid
        return ms + (self.large_eager_ms if eager else 0.0)

    def unpadded_ms(self, key: GraphKey, real: int, eager: bool) -> float:
        """What-if (gpu_sim --what-if unpadded): an M_L forward over its `real` tokens alone,
        with no padding and no gathered copies of the slots' keys, at the measured dense view
        with the fewest token slots (rows x k) that hold them, same L; past the grid, as
        large_ms extrapolates. An estimate of a layout that does not exist."""
        dense = [(r * k, ms) for (d, r, k, n), ms in self.large.items() if d and n == key.length and r * k >= real]
        if not dense:
            return self.large_ms(
                GraphKey(True, key.rows, key.k, key.length, key.last_only, key.hidden_layer), real, eager
            )
        return min(dense)[1] + (self.large_eager_ms if eager else 0.0)

    def ragged_ms(self, tokens: int) -> float:
        """An estimate of a ragged M_L forward of `tokens` (a token bucket, padding included)
        before a GPU has timed one: the measured dense view with the fewest token slots that
        hold them at the shortest L (its attention reads each slot's own blocks, no length
        bucket), as `unpadded_ms` prices the real tokens alone."""
        shortest = min(n for *_, n in self.large)
        return self.unpadded_ms(GraphKey(True, 1, tokens, shortest, True, None), tokens, False)

    def scaled(self, share: float) -> GpuCosts:
        """These costs with M_L's forwards (padded and ragged, timed or estimated) at `share` of
        their time, M_S's steps and the host kept: another card's M_L from this one's run, where
        M_L is bound by its weights' bandwidth (0.7: an H200's 1.43x against an H100's run)."""
        if share == 1.0:
            return self
        return dataclasses.replace(
            self,
            large={key: ms * share for key, ms in self.large.items()},
            ragged={tokens: ms * share for tokens, ms in self.ragged.items()},
            large_eager_ms=self.large_eager_ms * share,
            source=f"{self.source}; M_L's forwards x{share:g}",
        )

    def small_ms(self, key: GraphKey, eager: bool) -> float:
        if eager:
            return self.small_eager_ms
        rows = sorted(self.small_rows)
        r = rows[min(bisect.bisect_left(rows, key.rows), len(rows) - 1)]
        if (r, key.k) in self.small_k:  # measured by the probe (gpu_check.probes)
            return self.small_k[(r, key.k)]
        return self.small_rows[r] * (1.0 + 0.05 * (key.k - 1))  # k = 2 (a draft's bonus): a little more

    @classmethod
    def from_results(cls, folder: Path = GPU_RESULTS, **host) -> GpuCosts:
        """A GPU run's files: gpu_check.json's replay times of every captured graph where it
        has them (runs since the blocks layout), else catch_up_anatomy.json's M_L grid and
        gpu_check.json's M_S step anatomy (rows 1 and 64, linear between). host: the
        constants of a step's host work (keyword arguments of the same names)."""
        check = json.loads((folder / "gpu_check.json").read_text())
        table = check.get("replay_ms") or {}
        plain = {
            name: {
                (e["dense"], e["rows"], e["k"], e["L"]): e["ms"]
                for e in entries
                if e["last_only"] and e["layer"] is None
            }
            for name, entries in table.items()
        }
        sources = [f"{folder}/gpu_check.json ({check.get('gpu')})"]
        large = plain.get("large")
        if not large:
            anatomy = json.loads((folder / "catch_up_anatomy.json").read_text())
            large = {(g["dense"], g["rows"], g["k"], g["L"]): g["ms"] for g in anatomy["grid"]}
            sources.append(f"{folder}/catch_up_anatomy.json")
            if anatomy.get("gpu") and anatomy["gpu"] != check.get("gpu"):  # runs before 2026-11-26 name none
                mixed = f"M_L's grid from {anatomy['gpu']}, the rest from {check.get('gpu')}"
                warnings.warn(f"{folder}: two GPUs' costs mixed: {mixed} (run the `tests` stage on one)", stacklevel=2)
                sources.append(f"MIXED: {mixed}")
        if plain.get("small"):
            small = {
                r: ms
                for (dense, r, k, n), ms in plain["small"].items()
                if dense and k == 1 and n == min(key[3] for key in plain["small"])
            }
        else:
            small = {s["rows"]: s["graph_replay_ms"] for s in check["step_anatomy"]["M_S fused projections and norms"]}
        ones, lasts = min(small), max(small)  # linear in rows between the measured
        small_rows = {
            r: small.get(r, small[ones] + (small[lasts] - small[ones]) * (r - ones) / max(1, lasts - ones))
            for r in (1, 2, 4, 8, 16, 32, 64)
        }
        probes = check.get("probes")
        small_k, eager = {}, {"large_eager_ms": 65.0, "small_eager_ms": 66.0}
        if isinstance(probes, dict):  # a failed probe is a string: the estimates stay
            least = min(e["L"] for e in probes["small_k"])
            small_k = {(e["rows"], e["k"]): e["ms"] for e in probes["small_k"] if e["dense"] and e["L"] == least}
            prefill = probes["prefill_ms"]
            eager = {
                "large_eager_ms": max(0.0, prefill["large"]["eager"] - prefill["large"]["graphs"]),
                "small_eager_ms": prefill["small"]["eager"],
            }
            sources.append(f"{folder}/gpu_check.json probes")
        ragged = check.get("ragged")  # a failed probe is a string
        ragged = {int(t): ms for t, ms in ragged["replay_ms"].items()} if isinstance(ragged, dict) else {}
        timeline = folder / "step_timeline.json"
        if timeline.exists():  # the keyword arguments given stand
            host = fit_host(json.loads(timeline.read_text())) | host
            sources.append(f"{timeline} (the host)")
        shared = check.get("sharing")  # a failed probe is a string
        shared = shared if isinstance(shared, dict) else {}
        return cls(
            large=large,
            small_rows=small_rows,
            small_k=small_k,
            ragged=ragged,
            sharing=_slowdowns(shared),
            sharing_first={side: s for side, probe in shared.get("first", {}).items() if (s := _slowdowns(probe))},
            large_eager_ms=host.pop("large_eager_ms", eager["large_eager_ms"]),
            small_eager_ms=host.pop("small_eager_ms", eager["small_eager_ms"]),
            host_ms=host.pop("host_ms", 0.25),
            host_ms_per_row=host.pop("host_ms_per_row", 0.007),
            host_ms_per_catch_up=host.pop("host_ms_per_catch_up", 0.35),
            source=", ".join(sources),
            gpu=check.get("gpu") or "",
        )


def fit_host(timeline: dict) -> dict[str, float]:
    """step_timeline.json -> GpuCosts' host constants (ms). A run's time beyond its forwards'
    (the median plain run's wall less the forwards' device time of the timed run, the same
    requests: the host's work the device waits for, and the draws' kernels, which the
    simulator prices with the host) is `a * steps + b * rows stepped + c * catch-up forwards`,
    every generated token one row stepped. always-small at n = 1 and at the most streams give
    a (per step) and b (per row); always-large at the most streams, one catch-up a step,
    gives c from what it spends beyond that."""
    tokens, rows = timeline["tokens"], timeline["rows"]
    counts = sorted(int(n) for n in rows["always-small"] if n.isdigit())

    def beyond(label: str, n: int) -> tuple[float, int, int, int]:  # (ms, steps, rows stepped, M_L forwards)
        cell = rows[label][str(n)]
        forwards = cell["events_run"]["forwards"]
        model_ms = sum(f["ms"] for name, f in forwards.items() if name != "draws")
        large = sum(f["count"] for name, f in forwards.items() if name.startswith("large"))
        return 1e3 * cell["seconds"] - model_ms, cell["steps"], tokens * n, large

    (t1, s1, r1, _), (t2, s2, r2, _) = beyond("always-small", counts[0]), beyond("always-small", counts[-1])
    per_row = max(0.0, (t2 / s2 - t1 / s1) / (r2 / s2 - r1 / s1))
    per_step = max(0.0, t1 / s1 - per_row * r1 / s1)
    tl, sl, rl, forwards = beyond("always-large", counts[-1])
    per_catch_up = max(0.0, (tl - per_step * sl - per_row * rl) / max(1, forwards))
    return {"host_ms": per_step, "host_ms_per_row": per_row, "host_ms_per_catch_up": per_catch_up}


def measured_on(folder: Path, gpu: str) -> Path | None:
    """The batch_scaling-TAG.json in `folder` measured on `gpu` (its "gpu"), so a simulation at
    a run's costs is set beside the same card's throughput; None where no file is. The shortest
    name first: the batch stage's own file (`batch_scaling-h200.json`), not a rerun of some of
    its rows under a longer tag (`batch_scaling-h200-repeats5.json`)."""
    for path in sorted(folder.glob("batch_scaling-*.json"), key=lambda p: (len(p.name), p.name)):
        if json.loads(path.read_text()).get("gpu") == gpu:
            return path
    return None


def _slowdowns(probe: dict | None) -> tuple[float, float] | None:
    """(M_S's, M_L's) slowdown of a `sharing` probe's entry, None where it has none."""
    return (probe["small_slowdown"], probe["large_slowdown"]) if probe and "small_slowdown" in probe else None
