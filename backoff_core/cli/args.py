"""Argument groups shared by the `backoff` subcommands (models, routing, sampling)."""

from __future__ import annotations

import argparse

from backoff_core.types import COMPILE_MODES, RAGGED_MODES, Verification, parse_thresholds

QUANTIZE_CHOICES = ("none", "fp8")  # backoff_core.models.fp8.QUANTIZE_MODES (not imported: no torch at parse time)
AUTO_BOOL = ("auto", "true", "false")  # the command line's spelling of a setting that is "auto" | bool


def auto_bool(text: str) -> bool | str:
    """One of AUTO_BOOL as the settings take it: True, False or "auto"."""
    return {"true": True, "false": False}.get(text, "auto")


def model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models (none named: the embedded default pair)")
    g.add_argument("--small", help="M_S: local dir, cached HF id or .gguf file")
    g.add_argument("--large", help="M_L: local dir, cached HF id or .gguf file")
    g.add_argument("--medium", action="append", default=[], help="intermediate model(s), smallest first")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    g.add_argument("--device-map", default=None, help="accelerate device map (e.g. auto)")
    g.add_argument(
        "--cpu-kernels",
        default="mkldnn",
        choices=["mkldnn", "default"],
        help="linear layers on CPU float32: oneDNN (faster for every catch-up length) or torch's default",
    )
    for which in ("small", "large"):
        g.add_argument(
            f"--quantize-{which}",
            choices=QUANTIZE_CHOICES,
            default="none",
            help=f"M_{which[0].upper()}'s decoder linear layers in fp8 (e4m3, 128x128 block scales; W8A8 on GPUs "
            "with fp8 tensor cores, weight-only elsewhere: docs/fp8.md), or none (default)",
        )
    g.add_argument(
        "--kv-budget",
        type=int,
        default=None,
        help="static KV storage: positions per model (slots of --max-len); with cuda, CUDA graphs "
        "for steps and short catch-ups, captured at load. Default: per-session caches",
    )
    g.add_argument("--max-len", type=int, default=2048, help="static KV: positions per slot (prompt + output)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="static KV without CUDA graphs (eager)")
    g.add_argument(
        "--ragged-catch-ups",
        nargs="?",
        choices=RAGGED_MODES,
        const="on",
        default="auto",
        help="static KV on CUDA: the large model's catch-ups as ragged forwards, unpadded (docs/gpu.md): auto "
        "(default; with CUDA graphs, each catch-up ragged where its replays were timed faster), on (alone: on), off",
    )
    g.add_argument(
        "--compile-layers",
        choices=COMPILE_MODES,
        default="auto",
        help="static KV: every decoder layer one inductor-compiled function, fewer kernels a step (docs/gpu.md): "
        "auto (default; where CUDA graphs capture it), on (also eagerly), off",
    )


def load_spec(args: argparse.Namespace):
    """The LoadSpec of model_args' options."""
    from backoff_core.models.loading import LoadSpec

    return LoadSpec(
        args.device,
        args.dtype,
        args.device_map,
        args.cpu_kernels,
        quantize_small=args.quantize_small,
        quantize_large=args.quantize_large,
    )


def parallel_args(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism (backoff_core/parallel, docs/tensor-parallel.md): a model over N ranks."""
    g = p.add_argument_group("tensor parallelism (rank processes on this machine: gloo on CPU, NCCL on GPUs)")
    g.add_argument("--small-tp", type=int, default=1, metavar="N", help="M_S over N ranks (default 1)")
    g.add_argument(
        "--large-tp",
        type=int,
        default=1,
        metavar="N",
        help="M_L over N ranks (default 1); N must divide its heads and MLP width, and divide its KV heads "
        "or be a multiple of them (otherwise refused at start-up, naming the sizes that work)",
    )


def thresholds_arg(text: str) -> tuple[float, ...] | None:
    """--threshold "2,4": parse_thresholds' tuple, its refusal an argparse error; "" is none."""
    try:
        return parse_thresholds(text) if text else None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def routing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing")
    g.add_argument(
        "--router",
        default=None,
        help="decision function: always-small, always-large, oracle, flipped-oracle, entropy, max-prob, "
        "random, classifier (default, with no --threshold/--rate/--target-backoff: the packaged default "
        "routing, deployments/serve_config.yaml's)",
    )
    g.add_argument(
        "--threshold",
        type=thresholds_arg,
        default=None,
        help="threshold (comma-separated, ascending, one per boundary for chains)",
    )
    g.add_argument("--rate", type=float, default=None, help="random router: backoff rate (share of steps on M_S)")
    g.add_argument(
        "--target-backoff",
        type=float,
        default=None,
        help="ask for a backoff rate; a controller moves the threshold during generation",
    )
    g.add_argument("--classifier", default=None, help="router head directory (router-train output)")
    g.add_argument("--mode", choices=("backoff", "speculative"), default="backoff")
    g.add_argument("--draft-tokens", type=int, default=4, help="speculative mode: drafts per verification (initial)")
    g.add_argument(
        "--draft-schedule",
        choices=("heuristic", "constant"),
        default="heuristic",
        help="heuristic: +2 drafts after a fully accepted verification, -1 after a rejection",
    )
    g.add_argument(
        "--verification",
        choices=[v.value for v in Verification],
        default=None,
        help="check pending tokens at catch-up (default: none; speculative: exact)",
    )
    g.add_argument("--tolerance", type=float, default=float("inf"), help="KL tolerance for --verification kl")
    g.add_argument("--eager-prefill", action="store_true", help="prefill M_L's prompt at admission")


def sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
