"""fp8 quality on the real default pair, on the CPU (issue 53 item 2; docs/fp8.md).

    python benchmarks/fp8_quality.py                 # -> benchmarks/results/fp8_quality.json
    python benchmarks/fp8_quality.py --windows 2 --seq-len 32 --task-limit 0   # a quick look
    python benchmarks/fp8_quality.py --large-checkpoint DIR   # only M_L as `backoff quantize` wrote it

Each model of the embedded default pair (M_L SmolLM2-135M, M_S its 5-layer student), in fp8
(backoff_core/models/fp8.py: 128 x 128 weight blocks) against itself in float32, teacher-forced
on held-out text (the corpus' held-out split: stdlib sources, docstrings, pydoc topics;
`--windows` windows of `--seq-len` tokens a source): at every position the top-1 agreement,
KL(full || fp8) and its 99th percentile. Two fp8 forms, each figure from the same stored weights:
  w8a8         activations quantised per 1 x 128 as the GPU's fp8 GEMM reads them (emulated on the
               CPU: `models`, the figures the goals are read against: the GPU runs this)
  weight_only  the activations in float32 (what the CPU runs, and the GPU too for layers whose
               sizes are not multiples of 128, all of SmolLM2-135M's: `weight_only`)
each for two choices of the same format's e4m3 values: round-to-nearest (`quantize: fp8`,
fp8.quantize_model: `models`, `weight_only`) and GPTQ (fp8_gptq.gptq_quantize_model, calibrated
on `--calib-windows` windows of 128 tokens a source of the corpus' train split: `gptq`).
Then the shipped task set (frontier_spec.TASKS, `--task-limit` items a task) through the
`backoff` lm-eval model (backoff lm-eval's, in this process) with always-large, float32 against
fp8 (w8a8, round-to-nearest; `fp8_gptq`: GPTQ's), as the frontier scores a row (evaluation/frontier.py evaluate_row), the CPU's tok/s
of each beside it. Writes
    {"models": {"large": {"top1_agreement", "mean_kl", "p99_kl"}, "small": {...}},
     "weight_only": {...}, "gptq": {"models": {...}, "weight_only": {...}},
     "tasks": {"full": mean accuracy, "fp8": mean accuracy, "fp8_gptq": ...,
               "fp8_gptq_weight_only": (--large-checkpoint's), ...},
     "checkpoint": {"large": {...}, "written_by": its fp8_quantize.json}, ...}
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the checkout importable
from backoff_core.cli.quantize import Calibration, calibration_windows
from backoff_core.engine.engine import BackoffEngine
from backoff_core.evaluation.frontier import LARGE_ALONE, FrontierConfig, evaluate_row
from backoff_core.models.fp8 import BLOCK, keep_dequantized, set_activations
from backoff_core.models.fp8_export import RECORD, checkpoint_record, save_fp8_checkpoint
from backoff_core.models.fp8_gptq import ACT_ORDER, DAMP, gptq_quantize_model
from backoff_core.models.loading import Chain, LoadSpec, load_chain, load_model
from scripts.eval_small import heldout_windows

OUT = Path("benchmarks/results/fp8_quality.json")
FORMS = {"w8a8": "fp8", "weight_only": "none"}  # the result's key -> FP8Linear.activations


@torch.no_grad()
def compare(full, fp8, windows: torch.Tensor, desc: str) -> dict:
    """Teacher-forced over windows [n, T]: top-1 agreement, mean and p99 of KL(full || fp8)."""
    kls, agree = [], []
    for row in tqdm(windows, desc=desc, unit="window"):
        a = full(row[None]).logits[0].float().log_softmax(-1)  # [T, V]
        b = fp8(row[None]).logits[0].float().log_softmax(-1)
        kls.append((a.exp() * (a - b)).sum(-1))
        agree.append(a.argmax(-1) == b.argmax(-1))
    kl, same = torch.cat(kls), torch.cat(agree).float()
    return {
        "top1_agreement": round(same.mean().item(), 4),
        "mean_kl": round(kl.mean().item(), 5),
        "p99_kl": round(kl.quantile(0.99).item(), 5),
        "positions": int(kl.numel()),
    }


def measure(fp8, full, windows: torch.Tensor, tag: str) -> dict:
    """{"models": w8a8 figures, "weight_only": ...} of an fp8 chain against the full one."""
    result = {}
    for form, activations in FORMS.items():
        for model in fp8.models:
            set_activations(model, activations)
        key = "models" if form == "w8a8" else form
        result[key] = {
            name: compare(full.models[level], fp8.models[level], windows, f"{tag} {form} {name}")
            for level, name in ((1, "large"), (0, "small"))
        }
    for model in fp8.models:
        set_activations(model, "fp8")  # the tasks: the GPU's numbers
    return result


def tasks(full_chain, fp8_chains: dict, limit: int | None, speed_tokens: int) -> dict:
    """The task set, always-large, float32 (full_chain None: not run) and each fp8 chain: the
    mean accuracy of each (and per task)."""
    config = FrontierConfig(pair="default", limit=limit, speed_tokens=speed_tokens)
    out = {}
    rows = ([("full", full_chain)] if full_chain is not None else []) + list(fp8_chains.items())
    for name, chain in rows:
        start = time.perf_counter()
        row = evaluate_row(BackoffEngine.from_chain(chain), LARGE_ALONE, config)
        out[name] = round(row["mean_accuracy"], 4)
        out[f"{name}_per_task"] = {t: round(a, 4) for t, a in row["accuracy"].items()}
        out[f"{name}_tok_per_s_cpu"] = {n: round(v, 2) for n, v in row["tok_per_s"].items()}
        out[f"{name}_seconds"] = round(time.perf_counter() - start, 1)
    out["items_per_task"] = limit
    out["router"] = LARGE_ALONE.router
    return out


def checkpoint_rows(full, directory: Path, windows: torch.Tensor, args) -> tuple[dict, dict]:
    """M_L read from an fp8 checkpoint directory (`backoff quantize`'s) as a server loads a
    directory (load_model: fp8_checkpoint's compressed-tensors path), against float32 on the
    held-out windows and through the task set, always-large, weight-only (what SmolLM2's 576-wide
    layers run on every device): (the result's "checkpoint", its task rows)."""
    large = keep_dequantized(load_model(str(directory), LoadSpec(cpu_kernels="default"))[0])
    record = json.loads((directory / RECORD).read_text()) if (directory / RECORD).is_file() else {}
    entry = {"large": compare(full.models[1], large, windows, "checkpoint large"), "form": "weight_only"}
    entry["written_by"] = record
    if not args.task_limit:
        return entry, {}
    name = f"fp8_{record.get('method', 'checkpoint')}_weight_only"
    chain = Chain((full.models[0], large), full.tokenizer, (full.names[0], str(directory)))
    rows = tasks(None, {name: chain}, None if args.task_limit < 0 else args.task_limit, args.speed_tokens)
    return entry, {k: v for k, v in rows.items() if k.startswith(name)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=8, help="held-out windows per corpus source")
    p.add_argument("--seq-len", type=int, default=64, help="tokens a window")
    p.add_argument("--task-limit", type=int, default=25, help="items a task (0: no tasks, -1: all)")
    p.add_argument("--speed-tokens", type=int, default=8, help="tokens a stream of the tok/s beside each task row")
    p.add_argument("--calib-windows", type=int, default=24, help="GPTQ's calibration windows per corpus source")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest on a loaded 2-core machine)")
    p.add_argument(
        "--large-checkpoint",
        type=Path,
        default=None,
        help="only the rows of M_L from this fp8 checkpoint directory (`backoff quantize`), merged into --out",
    )
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python benchmarks/fp8_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    full = load_chain(None, None, spec=LoadSpec(cpu_kernels="default"))
    windows = torch.cat(list(heldout_windows(full.tokenizer, args.seq_len, args.windows).values()))  # [n, T]
    if args.large_checkpoint is not None:  # its rows alone, merged into the file
        result = json.loads(args.out.read_text()) if args.out.is_file() else {}
        result["checkpoint"], rows = checkpoint_rows(full, args.large_checkpoint, windows, args)
        result["checkpoint"]["command"] = command
        result.setdefault("tasks", {}).update(rows)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["checkpoint"], indent=2))
        return 0
    fp8 = load_chain(None, None, spec=LoadSpec(cpu_kernels="default", quantize_small="fp8", quantize_large="fp8"))
    gptq = copy.deepcopy(full)  # its own pair (the unquantised default pair is the process's cached one)
    calib = calibration_windows(full.tokenizer, Calibration(per_source=args.calib_windows))  # [n, 128]
    for model in gptq.models:
        gptq_quantize_model(model, calib)
    with tempfile.TemporaryDirectory() as tmp:  # GPTQ's M_L as `backoff quantize` writes it, and read back
        calibration = {"texts": "corpus train split", "per_source": args.calib_windows, "seq_len": 128}
        record = checkpoint_record("default-large", "gptq", "float32", dict(calibration, windows=len(calib)))
        written = save_fp8_checkpoint(gptq.models[1], full.tokenizer, Path(tmp) / "large", record=record)
        checkpoint = checkpoint_rows(full, written, windows, args)
    for model in (*fp8.models, *gptq.models):  # dequantised once, not at every forward: the same numbers, faster here
        keep_dequantized(model)
    result: dict = measure(fp8, full, windows, "rtn")
    result["gptq"] = measure(gptq, full, windows, "gptq")
    if args.task_limit:
        limit = None if args.task_limit < 0 else args.task_limit
        result["tasks"] = tasks(full, {"fp8": fp8, "fp8_gptq": gptq}, limit, args.speed_tokens) | checkpoint[1]
    result["checkpoint"] = checkpoint[0]
    result["setup"] = {
        "pair": "default (M_L SmolLM2-135M-Instruct, M_S the 5-layer student)",
        "block": list(BLOCK),
        "windows": int(windows.shape[0]),
        "seq_len": args.seq_len,
        "held_out": "corpus heldout split: stdlib_source, stdlib_docstrings, pydoc_topics",
        "reference": "float32 on the CPU",
        "tasks_fp8": "w8a8 (activations quantised per 1x128 as the GPU's GEMM reads them)",
        "gptq": {
            "calibration": "corpus train split",
            "windows": int(calib.shape[0]),
            "seq_len": 128,
            "damp": DAMP,
            "act_order": ACT_ORDER,
        },
        "command": command,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
