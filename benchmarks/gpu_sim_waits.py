"""The hold's time bound (`catch_up_wait_ms`) swept in the simulator (gpu_sim.py): random b=0.9
at n streams, together (as batch_scaling.py runs them) and kept busy (`--sustained`'s load),
with M_L's catch-ups padded (the default blocks layout) and ragged.

    python benchmarks/gpu_sim_waits.py     # -> benchmarks/results/gpu_sim_waits.json

Reads whether the default bound (40 ms) cuts the hold short at the GPU run's costs: where it
does, a longer bound takes fewer M_L forwards and more tokens a second (docs/gpu.md)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_costs import GPU_RESULTS, GpuCosts  # noqa: E402
from benchmarks.gpu_sim import B09, build, run_batch, run_sustained  # noqa: E402

WAITS_MS = (40.0, 80.0, 160.0, 1000.0)


def sweep(costs: GpuCosts, waits: tuple[float, ...], streams: int, tokens: int, seeds: int = 3) -> dict:
    """{"blocks"|"ragged": {wait: row}}: each row the median of `seeds` batches of `streams`
    requests together (tok/s, its ratio to one stream, M_L forwards) and one kept-busy run."""
    out: dict[str, dict[str, dict]] = {}
    for layout in tqdm(("blocks", "ragged"), desc="layouts"):
        sim = build(costs, ragged="on" if layout == "ragged" else "off")
        one = statistics.median(run_batch(sim, 1, tokens, B09, seed)["tok_per_s"] for seed in range(seeds))
        rows = {}
        for wait in waits:
            sim.engine.catch_up_wait_ms = wait
            runs = [run_batch(sim, streams, tokens, B09, seed) for seed in range(seeds)]
            together = statistics.median(r["tok_per_s"] for r in runs)
            rows[f"{wait:g}"] = {
                "together_tok_per_s": round(together, 1),
                "together_vs_one": round(together / one, 2),
                "large_forwards": statistics.median(r["large_forwards"] for r in runs),
                "kept_busy_tok_per_s": round(run_sustained(sim, streams, tokens, B09)["tok_per_s"], 1),
            }
        out[layout] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", default=str(GPU_RESULTS), help="the GPU run's results folder")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--waits", default=",".join(f"{w:g}" for w in WAITS_MS), help="bounds in ms, comma-separated")
    ap.add_argument("--out", default="benchmarks/results/gpu_sim_waits.json")
    args = ap.parse_args()
    waits = tuple(float(w) for w in args.waits.split(","))
    table = sweep(GpuCosts.from_results(Path(args.costs)), waits, args.streams, args.tokens)
    print(f"\nrandom b=0.9, {args.streams} streams: together tok/s (x one stream, M_L forwards) | kept busy tok/s")
    for layout, rows in table.items():
        for wait, row in rows.items():
            print(
                f"{layout:7s} {wait:>6s} ms  {row['together_tok_per_s']:8.0f} ({row['together_vs_one']:5.2f}x, "
                f"{row['large_forwards']:g})  | {row['kept_busy_tok_per_s']:8.0f}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"streams": args.streams, "tokens": args.tokens, "routing": "random b=0.9", "waits_ms": table}
    out.write_text(json.dumps(payload, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
