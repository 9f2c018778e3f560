"""How a compiled layer attends (static_compiled.attend), each way side by side in one run: the
step graphs of M_S (1 and 64 rows over 256 and 1024 keys) and M_L (1 row), replayed.

    python3 benchmarks/compiled_attention.py --small /tmp/pair/small --large /tmp/pair/large \
        --tag h200 --ways sdpa,efficient,math,reduce

For each way: M_S's and M_L's static runners with compiled layers, only those graphs
captured (compiles and capture timed), each replayed 50 times (median, CUDA events) with a
torch.profiler kernel table (benchmarks/fused_step.replay_profile), and each graph's logits
against the first way's on the same inputs (relative error: every way computes the same
attention). Saves benchmarks/results/gpu/compiled_attention[-TAG].json after every way; a
way that raises is reported in "errors" and the others measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the packages importable
from backoff_core.models.loading import LoadSpec, load_chain  # noqa: E402
from backoff_core.runners.graph_plan import GraphKey  # noqa: E402
from backoff_core.runners.static import StaticRunner  # noqa: E402
from benchmarks.fused_step import replay_profile  # noqa: E402
from benchmarks.pair_args import pair_args  # noqa: E402

GRAPHS = {  # model -> (rows, keys read) of its one-token step graphs
    "small": [(1, 256), (1, 1024), (64, 256), (64, 1024)],
    "large": [(1, 256), (1, 1024)],
}


@torch.inference_mode()
def measure_way(way: str, chain, args, reference: dict) -> dict:
    out: dict = {}
    for name, model in (("small", chain.models[0]), ("large", chain.models[-1])):
        start = time.perf_counter()
        run = StaticRunner(
            model, name, kv_budget_tokens=args.kv_budget, max_len=args.max_len, compile_layers=True, attention=way
        )
        keys = [GraphKey(True, rows, 1, length, True, None) for rows, length in GRAPHS[name]]
        run.graphs.capture(keys, progress=False)
        compiled = run._forward.compiled
        out[f"{name} load"] = {
            "seconds": round(time.perf_counter() - start, 1),
            "compiles": compiled.compiles,
            "compile_s": round(compiled.compile_s, 1),
        }
        for key in keys:
            label = f"{name} rows={key.rows} keys={key.length}"
            profile = replay_profile(run, key)
            logits = run.graphs._outputs(key)[0].float().clone()
            if label in reference:
                ref = reference[label]
                profile["rel_err_vs_first"] = float((logits - ref).norm() / ref.norm())
            else:
                reference[label] = logits
            out[label] = profile
            print(f"[{way}] {label}: {profile['replay_ms']} ms, {profile['kernels']} kernels", flush=True)
        del run, compiled
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_args(ap)
    ap.add_argument("--ways", default="sdpa,efficient,math,reduce")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="benchmarks/results/gpu")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("compiled_attention" + (f"-{args.tag}" if args.tag else "") + ".json")
    chain = load_chain(args.small, args.large, (), LoadSpec(args.device, args.dtype))
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ways": {}, "errors": {}}
    reference: dict = {}
    for way in args.ways.split(","):
        try:
            report["ways"][way] = measure_way(way, chain, args, reference)
        except Exception as exc:  # noqa: BLE001 - reported, the other ways go on
            report["errors"][way] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"[{way}] FAILED: {report['errors'][way][:300]}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
        path.write_text(json.dumps(report, indent=2))
    for label in reference:
        cells = [f"{way} {r[label]['replay_ms']:.3f}" for way, r in report["ways"].items() if label in r]
        print(f"{label}: " + ", ".join(cells))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
