"""How much dearer than the simulator prices it may a ragged M_L forward be before random b=0.9
at 64 streams falls under 20x one stream (the GPU engine's open goal)? gpu_sim.py's
`--what-if ragged` at the GPU run's costs, each ragged forward made dearer three ways:

- `per_forward_ms`: a fixed cost a forward (launches, the block mask's kernels);
- `factor`: the whole forward by a factor (the flex kernel or the projections slower);
- `per_token_us`: a cost a token (attention or index_put_ that scale with the tokens).

    python benchmarks/gpu_sim_margin.py    # -> benchmarks/results/gpu_sim_margin.{json,png}

For each way it prints the ratio at a few points and the break-even, found by bisection (the
simulator is deterministic for its seeds). The price it starts from is the one gpu_sim uses:
gpu_check.json's `ragged` probe where the run timed the ragged graphs, else the measured dense
view of as many token slots (GpuCosts.ragged_ms). Where the probe exists, it also prints each
bucket's replay over that estimate: a figure within the break-even `factor` keeps the goal."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backoff_core.runners.static_ragged import RAGGED_TOKENS  # noqa: E402
from benchmarks.gpu_costs import GPU_RESULTS, GpuCosts  # noqa: E402
from benchmarks.gpu_sim import B09, build, run_batch  # noqa: E402

GOAL = 20.0
# each way of making a ragged forward dearer: (price in ms, tokens, how much) -> dearer price
WAYS: dict[str, Callable[[float, int, float], float]] = {
    "per_forward_ms": lambda ms, tokens, x: ms + x,
    "factor": lambda ms, tokens, x: ms * x,
    "per_token_us": lambda ms, tokens, x: ms + tokens * x / 1000,
}
NEUTRAL = {"per_forward_ms": 0.0, "factor": 1.0, "per_token_us": 0.0}
POINTS = {"per_forward_ms": (0.5, 2.0, 8.0), "factor": (1.1, 1.25, 1.5), "per_token_us": (2.0, 5.0, 10.0)}
LIMIT = {"per_forward_ms": 64.0, "factor": 4.0, "per_token_us": 100.0}  # bisection stops there


def base_prices(costs: GpuCosts) -> dict[int, float]:
    """The price gpu_sim gives each token bucket's ragged forward: the probe's replay, else the
    dense-view estimate."""
    return {tokens: costs.ragged.get(tokens) or costs.ragged_ms(tokens) for tokens in RAGGED_TOKENS}


def ratio(costs: GpuCosts, prices: dict[int, float], streams: int, tokens: int, seeds: int) -> dict:
    """random b=0.9 with ragged catch-ups at `prices`: the median tok/s of `seeds` batches at
    one stream and at `streams`, and their ratio."""
    sim = build(dataclasses.replace(costs, ragged=prices), ragged="on")
    one = statistics.median(run_batch(sim, 1, tokens, B09, seed)["tok_per_s"] for seed in range(seeds))
    top = statistics.median(run_batch(sim, streams, tokens, B09, seed)["tok_per_s"] for seed in range(seeds))
    return {"one_tok_per_s": round(one, 1), "top_tok_per_s": round(top, 1), "ratio": round(top / one, 3)}


def break_even(at: Callable[[float], float], low: float, high: float, goal: float, steps: int = 10) -> float | None:
    """The x in [low, high] where at(x) falls to `goal` (at decreasing in x), by bisection;
    None where at(high) still meets it, `low` where at(low) does not."""
    if at(high) >= goal:
        return None
    if at(low) < goal:
        return low
    for _ in range(steps):
        mid = (low + high) / 2
        low, high = (mid, high) if at(mid) >= goal else (low, mid)
    return round((low + high) / 2, 3)


def margins(costs: GpuCosts, streams: int, tokens: int, seeds: int, goal: float = GOAL, steps: int = 10) -> dict:
    """The ratio as priced, then for each way of WAYS the ratio at its POINTS and the break-even
    where it falls under `goal` (searched up to its LIMIT)."""
    base = base_prices(costs)
    known: dict[tuple, dict] = {}  # prices -> ratio: every way's NEUTRAL is the price as is

    def at(way: str, x: float) -> dict:
        prices = {t: WAYS[way](ms, t, x) for t, ms in base.items()}
        key = tuple(prices.values())
        if key not in known:
            known[key] = ratio(costs, prices, streams, tokens, seeds)
        return known[key]

    out = {"base_ms": {str(t): round(ms, 3) for t, ms in base.items()}, "as_priced": at("factor", 1.0), "ways": {}}
    for way in tqdm(WAYS, desc="ways"):
        out["ways"][way] = {
            "points": {f"{x:g}": at(way, x) for x in POINTS[way]},
            "break_even": break_even(lambda x, way=way: at(way, x)["ratio"], NEUTRAL[way], LIMIT[way], goal, steps),
            "searched_up_to": LIMIT[way],
        }
    return out


def probe_over_estimate(costs: GpuCosts) -> dict[str, float]:
    """Each bucket the GPU run's `ragged` probe timed, its replay over the dense-view estimate."""
    return {str(t): round(ms / costs.ragged_ms(t), 3) for t, ms in sorted(costs.ragged.items())}


LABELS = {"per_forward_ms": "+ ms a forward", "factor": "x the whole forward", "per_token_us": "+ µs a token"}


def plot(table: dict, goal: float, path: Path) -> None:
    """One panel a way: the ratio against how much dearer, the goal and the break-even marked."""
    fig, axes = plt.subplots(1, len(WAYS), figsize=(12, 3.6), sharey=True)
    for ax, (way, row) in zip(axes, table["ways"].items()):
        xs = [NEUTRAL[way]] + [float(x) for x in row["points"]]
        ys = [table["as_priced"]["ratio"]] + [cell["ratio"] for cell in row["points"].values()]
        ax.plot(xs, ys, "o-")
        ax.axhline(goal, color="grey", linestyle="--", label=f"goal {goal:g}x")
        if row["break_even"] is not None:
            ax.axvline(row["break_even"], color="red", linestyle=":", label=f"break-even {row['break_even']:g}")
        ax.set_xlabel(f"ragged forward {LABELS[way]}")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("64 streams vs one (simulated)")
    fig.suptitle("random b=0.9, ragged catch-ups: the ratio as a ragged M_L forward gets dearer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", default=str(GPU_RESULTS), help="the GPU run's results folder")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--goal", type=float, default=GOAL, help="the ratio to keep (streams vs one)")
    ap.add_argument("--steps", type=int, default=10, help="bisection steps a break-even")
    ap.add_argument("--out", default="benchmarks/results/gpu_sim_margin.json")
    args = ap.parse_args()
    costs = GpuCosts.from_results(Path(args.costs))
    table = margins(costs, args.streams, args.tokens, args.seeds, args.goal, args.steps)
    measured = probe_over_estimate(costs)
    priced = table["as_priced"]
    print(
        f"\nrandom b=0.9, ragged catch-ups, {args.streams} streams vs one: {priced['ratio']:.2f}x as priced "
        f"({'the probe' if measured else 'the dense-view estimate'}); goal {args.goal:g}x"
    )
    for way, row in table["ways"].items():
        points = ", ".join(f"{x}: {cell['ratio']:.2f}x" for x, cell in row["points"].items())
        even = row["break_even"]
        said = f"over {row['searched_up_to']:g}" if even is None else f"{even:g}"
        print(f"{way:15s} {points}; under {args.goal:g}x from {said}")
    if measured:
        print(f"the probe's ragged replays over the dense-view estimate, by tokens: {measured}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "streams": args.streams,
        "tokens": args.tokens,
        "routing": "random b=0.9",
        "goal": args.goal,
        "costs": costs.source,
        "probe_over_estimate": measured,
    } | table
    out.write_text(json.dumps(payload, indent=2) + "\n")
    plot(table, args.goal, out.with_suffix(".png"))
    print(f"saved {out} and .png")


if __name__ == "__main__":
    main()
