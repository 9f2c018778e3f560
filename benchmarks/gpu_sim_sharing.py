"""Catch-ups in flight on one GPU: the simulated 64-streams-vs-one ratio over a grid of how
much M_S's steps and a flight's M_L forward slow each other side by side.

    python benchmarks/gpu_sim_sharing.py                  # the grid at the H100's measured costs, padded
    python benchmarks/gpu_sim_sharing.py --slowdowns 1 1.5 2 --repeats 1
    python benchmarks/gpu_sim_sharing.py --unpadded       # M_L's forwards without padding (not built)
    python benchmarks/gpu_sim_sharing.py --ragged         # M_L's catch-ups ragged (the default's choice
                                                          # at these prices: KVSpec ragged "auto")

gpu_sim.py --what-if shared prices one pair of slowdowns (a, b): gpu_check.json's `sharing`
probe where a run measured it, else fair sharing (2, 2). Before a GPU has measured them,
this says which (a, b) the flights need: the row "random b=0.9, in flight" (no hold) at n = 1
and 64 for every pair, beside the synchronous default and the flights on two timelines (M_L
on a GPU of its own), all at the same costs and seeds. So the probe's figures read off as a
prediction the moment they exist (`measured`: the row simulated at the probe's own (a, b),
of one priority and with either side first, where the run has them), and a stream priority
(flight.ThreadLauncher.first) is worth what it moves (a, b) across the grid. --unpadded: the
same with M_L's forwards priced without padding (gpu_sim --what-if unpadded, a layout not
built); --ragged: M_L's catch-ups as ragged forwards (gpu_sim --what-if ragged, static_ragged.py).
Deterministic (the clock is the costs). Writes
benchmarks/results/gpu_sim_sharing[-unpadded|-ragged].json and .png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_costs import GPU_RESULTS, GpuCosts  # noqa: E402
from benchmarks.gpu_sim import Sim, build, scaling  # noqa: E402

IN_FLIGHT, SYNCHRONOUS = "random b=0.9, in flight", "random b=0.9"


def ratio(sim: Sim, label: str, streams: tuple[int, int], tokens: int, repeats: int) -> dict:
    """One row of gpu_sim's ROUTINGS at n = streams (gpu_sim.scaling): median tok/s over
    seeds, and top over one."""
    tok = {
        int(n): cell["tok_per_s"] for n, cell in scaling(sim, list(streams), tokens, repeats, [label])[label].items()
    }
    return {
        "tok_per_s": {str(n): round(v, 1) for n, v in tok.items()},
        "ratio": round(tok[streams[1]] / tok[streams[0]], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slowdowns", nargs="+", type=float, default=[1.0, 1.25, 1.5, 2.0], help="a and b, each")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="seeds per cell (the median)")
    ap.add_argument("--costs", default=str(GPU_RESULTS), help="folder of the GPU run's json files")
    priced = ap.add_mutually_exclusive_group()
    priced.add_argument("--unpadded", action="store_true", help="M_L's forwards priced as gpu_sim --what-if unpadded")
    priced.add_argument("--ragged", action="store_true", help="M_L's catch-ups ragged, as gpu_sim --what-if ragged")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    costs = GpuCosts.from_results(Path(args.costs))
    streams = (1, 64)
    sim = build(costs, large_cost=costs.unpadded_ms if args.unpadded else None, ragged="on" if args.ragged else "off")
    reference = {
        "synchronous, held (the default)": ratio(sim, SYNCHRONOUS, streams, args.tokens, args.repeats),
        "in flight, two timelines": ratio(sim, IN_FLIGHT, streams, args.tokens, args.repeats),
    }
    grid, measured = {}, {}
    for a, b in tqdm(list(itertools.product(args.slowdowns, repeat=2)), desc="(a, b)"):
        sim.engine.launcher.sharing = (a, b)
        grid[f"{a:g},{b:g}"] = ratio(sim, IN_FLIGHT, streams, args.tokens, args.repeats)
    probed = {"one priority": costs.sharing} | {f"{side} first": s for side, s in costs.sharing_first.items()}
    for label, point in probed.items():  # where gpu_check.json's probe measured (a, b)
        if point is not None:
            sim.engine.launcher.sharing = point
            measured[label] = {"sharing": point} | ratio(sim, IN_FLIGHT, streams, args.tokens, args.repeats)
    report = {
        "what": "simulated (gpu_sim.py): random b=0.9 in flight (no hold) on one GPU, M_S's step a times "
        "slower beside a flight and the flight b times slower beside M_S's step; tok/s at n = 1 and 64",
        "costs": costs.source,
        "unpadded": args.unpadded,  # M_L's forwards at their real tokens' price (a layout not built)
        "ragged": args.ragged,  # M_L's catch-ups as ragged forwards (static_ragged.py)
        "tokens": args.tokens,
        "reference": reference,
        "grid": grid,  # "a,b" -> {tok_per_s, ratio}
        "measured": measured,  # at the (a, b) gpu_check.json's sharing probe measured, if a run did
    }
    _print(report, args.slowdowns)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / ("gpu_sim_sharing" + ("-unpadded" if args.unpadded else "-ragged" if args.ragged else ""))
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    _plot(report, args.slowdowns, stem.with_suffix(".png"))
    print(f"saved {stem}.json and .png")


def _print(report: dict, slowdowns: list[float]) -> None:
    for label, cell in report["reference"].items():
        print(f"{label}: {cell['ratio']:.1f}x ({cell['tok_per_s']['64']:.0f} tok/s at 64)")
    print("\nin flight on one GPU, 64 streams vs one (a: M_S's slowdown, down; b: M_L's, across)")
    print("a \\ b " + " ".join(f"{b:>7g}" for b in slowdowns))
    for a in slowdowns:
        print(f"{a:5g} " + " ".join(f"{report['grid'][f'{a:g},{b:g}']['ratio']:6.1f}x" for b in slowdowns))
    for label, cell in report["measured"].items():
        print(f"at the probe's {label} (a, b) = {cell['sharing']}: {cell['ratio']:.1f}x")
    if not report["measured"]:
        print("(no sharing probe in the GPU run's gpu_check.json yet: scripts/gpu_bench.sh tests measures it)")


def _plot(report: dict, slowdowns: list[float], path: Path) -> None:
    values = [[report["grid"][f"{a:g},{b:g}"]["ratio"] for b in slowdowns] for a in slowdowns]
    fig, ax = plt.subplots(figsize=(6, 5))
    image = ax.imshow(values, cmap="viridis", origin="lower")
    ax.set_xticks(range(len(slowdowns)), [f"{b:g}" for b in slowdowns])
    ax.set_yticks(range(len(slowdowns)), [f"{a:g}" for a in slowdowns])
    ax.set_xlabel("b: M_L's slowdown beside M_S's step")
    ax.set_ylabel("a: M_S's slowdown beside M_L's forward")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.1f}x", ha="center", va="center", color="white" if v < max(map(max, values)) else "k")
    sync = report["reference"]["synchronous, held (the default)"]["ratio"]
    priced = ", M_L unpadded" if report["unpadded"] else ", M_L ragged" if report.get("ragged") else ""
    ax.set_title(f"b=0.9 in flight on one GPU{priced}, 64 streams vs one\n(synchronous {sync:.1f}x; goal 20x)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
