"""A cached prompt prefix into a static KV slot (and a prefix out of one, to store it): the
host time a request, StaticKV.write / read (one op over every layer) against the per-layer
copies they replaced (two a layer), in the same run.

    python benchmarks/slot_prefix_load.py      # saves benchmarks/results/slot_prefix_load.json

On a GPU each op is a kernel launch, and admission runs them between steps: the fourth H100
run's profile had the per-layer loads at ~0.9 ms of the host a request at the 8B shape (32
layers: 64 launches). Models here are the pair's layer counts
(30 and 32) at a tiny width, so what is timed is the ops' host cost, not the copying. The
machine is shared and noisy: medians over --repeats rounds of --requests loads each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from backoff_core.runners.static_kv import StaticKV  # noqa: E402
from tests.support.tiny import tiny_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "slot_prefix_load.json"


def write_per_layer(kv: StaticKV, slot: int, block: torch.Tensor) -> None:
    """What StaticKV.write did before: two copies a layer."""
    n = block.shape[3]
    for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
        k[slot, :, :n] = block[layer, 0]
        v[slot, :, :n] = block[layer, 1]


def read_per_layer(kv: StaticKV, slot: int, start: int, stop: int) -> torch.Tensor:
    """What StaticKV.read did before: a slice a layer and model, stacked."""
    return torch.stack(
        [torch.stack((k[slot, :, start:stop], v[slot, :, start:stop])) for k, v in zip(kv.keys, kv.values)]
    )


def ms_a_request(fn, requests: int, repeats: int, device: torch.device) -> float:
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for slot in range(requests):
            fn(slot)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rounds.append(1e3 * (time.perf_counter() - start) / requests)
    return statistics.median(rounds)


def measure(layers: int, prefix: int, requests: int, repeats: int, device: torch.device) -> dict:
    model = tiny_model(2, hidden=64, layers=layers).to(device)
    kv = StaticKV(model, requests * 256, 256)
    block = torch.randn(layers, 2, kv.kv_heads, prefix, kv.head_dim, device=device)
    timed = {
        "write one op": lambda s: kv.write(s, block),
        "write per layer": lambda s: write_per_layer(kv, s, block),
        "read one op": lambda s: kv.read(s, 0, prefix),
        "read per layer": lambda s: read_per_layer(kv, s, 0, prefix),
    }
    ms = {name: ms_a_request(fn, requests, repeats, device) for name, fn in timed.items()}
    return {
        "ms_a_request": {k: round(v, 4) for k, v in ms.items()},
        "per_layer_over_one_op": {op: round(ms[f"{op} per layer"] / ms[f"{op} one op"], 1) for op in ("write", "read")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="30,32", help="comma-separated layer counts (the pair's: 30, 32)")
    ap.add_argument("--prefix", type=int, default=64, help="positions loaded a request")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    rows = {}
    for layers in (int(x) for x in args.layers.split(",")):
        rows[str(layers)] = row = measure(layers, args.prefix, args.requests, args.repeats, device)
        print(f"{layers} layers: {row}", flush=True)
    report = {"device": str(device), "prefix": args.prefix, "requests": args.requests, "repeats": args.repeats}
    report["layers"] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
