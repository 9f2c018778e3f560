"""The GPU stages' shared command-line options: which pair, on what, with how much static KV."""

from __future__ import annotations

import argparse


def pair_args(ap: argparse.ArgumentParser) -> None:
    """--small and --large (the pair's model folders: scripts/gpu_bench.sh builds them in
    /tmp/pair), --device, --dtype, and the static KV of each model (--kv-budget positions in
    slots of --max-len): the GPU stages' defaults, 64 slots of 1024 in bf16 on CUDA."""
    ap.add_argument("--small", required=True)
    ap.add_argument("--large", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-budget", type=int, default=65536)
    ap.add_argument("--max-len", type=int, default=1024)
