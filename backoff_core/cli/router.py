"""The router pipeline's subcommands of `backoff` (registered by cli.py):

router-data       teacher-forced M_S/M_L pass over a corpus -> shards + manifest
router-train      fit a ClassifierHead (binary / regression / buckets; pretrain + finetune)
router-calibrate  backoff rate -> threshold table on a calibration set, into head.json
evaluate          the paper's analyses + our goals -> report.md and PNGs under a run dir
evaluate-report   every PNG and report.md of a run dir again, from its results.json alone
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from backoff_core.cli.args import load_spec, model_args


def _threads(args) -> None:
    torch.set_num_threads(max(1, args.threads))
    torch.manual_seed(args.seed)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch CPU threads")


def _layers(text: str | None) -> tuple[int, ...] | None:
    if text in (None, "", "all"):
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--layers takes comma-separated integers or 'all', got {text!r}") from None


def _load_chain(args):
    from backoff_core.models.loading import load_chain

    return load_chain(args.small, args.large, args.medium, load_spec(args))


def _router_data(args) -> int:
    from backoff_core.learning.data import DataConfig, build
    from backoff_core.learning.sources import ChatGen

    _threads(args)
    cfg = DataConfig(
        corpora=tuple(args.corpus or ["stdlib:train"]),
        seq_len=args.seq_len,
        max_positions=args.max_positions,
        windows_per_doc=args.windows_per_doc,
        layers=_layers(args.layers),
        batch_size=args.batch_size,
        shard_windows=args.shard_windows,
        seed=args.seed,
        chat=ChatGen(samples=args.chat_samples, max_tokens=args.chat_max_tokens, seed=args.seed),
    )
    manifest = json.loads(build(_load_chain(args), cfg, args.out).read_text())
    print(
        f"{manifest['positions']} positions from {manifest['windows']} windows of {', '.join(cfg.corpora)} "
        f"-> {args.out} (layers {manifest['layers']})"
    )
    return 0


def _router_train(args) -> int:
    from backoff_core.learning import data as router_data
    from backoff_core.learning import train as router_train

    _threads(args)
    cfg = router_train.TrainConfig(
        layer=args.layer,
        objective=args.objective,
        inner_size=args.inner_size,
        percentile=args.percentile,
        epochs=args.epochs,
        finetune_epochs=args.finetune_epochs,
        lr=args.lr,
        finetune_lr=args.finetune_lr,
        batch_size=args.batch_size,
        val_fraction=args.val_fraction,
        seed=args.seed,
        features=tuple(f for f in (args.features or "").split(",") if f),
    )
    pretrain = router_data.load(args.data)
    finetune = router_data.load(args.finetune) if args.finetune else None
    head, log = router_train.train(
        cfg, pretrain, finetune, {"pretrain_data": args.data, "finetune_data": args.finetune or []}
    )
    router_train.save(head, log, args.out)
    val = head.meta.extra["val"]
    feats = f" + {','.join(cfg.features)}" if cfg.features else ""
    print(
        f"head ({cfg.objective}, layer {head.layer}{feats}, {head.meta.hidden_size}->{head.meta.inner_size}->"
        f"{head.meta.num_classes if cfg.objective != 'regression' else 1}) -> {args.out}; held-out windows: "
        f"gap closed {val['gap_closed']:.3f}, AUC(KL > T_KL) {val['auc_high_kl']:.3f}"
    )
    return 0


def _router_calibrate(args) -> int:
    from backoff_core.learning import data as router_data
    from backoff_core.learning.calibrate import DEFAULT_RATES, calibrate_dir

    _threads(args)
    rates = tuple(float(x) for x in args.rates.split(",")) if args.rates else DEFAULT_RATES
    summary = calibrate_dir(args.head, router_data.load(args.data), rates, source=",".join(args.data))
    worst = max(abs(a - r) for a, r in zip(summary["achieved"], summary["rates"]))
    print(
        f"calibrated {len(summary['rates'])} rates on {summary['positions']} positions "
        f"(max |achieved - target| on this set {worst:.4f}) -> {Path(args.head) / 'head.json'}"
    )
    for r, t, a in zip(summary["rates"], summary["thresholds"], summary["achieved"]):
        if round(r * 10, 6) == round(r * 10):  # print every 0.1
            print(f"  rate {r:.2f}  threshold {t:+.5f}  achieved {a:.3f}")
    return 0


def _evaluate(args) -> int:
    from backoff_core.evaluation.evaluate import EvalConfig, run

    _threads(args)
    cfg = EvalConfig(
        run_dir=Path(args.run_dir),
        head=args.head,
        heldout=tuple(args.heldout),
        calib=tuple(args.calib),
        compare=tuple(args.compare),
        unseen=tuple(args.unseen),
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        control_requests=args.control_requests,
        control_tokens=args.control_tokens,
        open_requests=args.open_requests,
        open_tokens=args.open_tokens,
        **({"rate_grid": tuple(float(x) for x in args.rate_grid.split(","))} if args.rate_grid else {}),
        grid_routers=tuple(args.grid_routers.split(",")),
        targets=tuple(float(x) for x in args.targets.split(",")),
        skip=tuple(args.skip),
        seed=args.seed,
    )
    report = run(cfg, _load_chain(args))
    print(f"report: {report}")
    return 0


def _evaluate_report(args) -> int:
    from backoff_core.evaluation.evaluate import rewrite

    report = rewrite(args.run_dir)
    print(f"wrote {report} and its plots")
    return 0


def _evaluate_merge(args) -> int:
    from backoff_core.evaluation.evaluate import merge

    report = merge(args.part, args.run_dir)
    print(f"wrote {report} and its plots from {len(args.part)} parts")
    return 0


def register(sub) -> None:

    p = sub.add_parser("router-data", help="teacher-forced router data (hidden states, KL, entropies) -> shards")
    model_args(p)
    p.add_argument("--out", required=True, help="run dir for shards + manifest.json (resumable)")
    p.add_argument(
        "--corpus",
        action="append",
        help="stdlib|docstrings|pydoc|notes|chat-general|chat-python"
        "[:train|calib|heldout], a .jsonl of chat records, or a file/dir of text (repeatable; "
        "default stdlib:train)",
    )
    p.add_argument("--max-positions", type=int, default=16384, help="positions in all, split over the corpora")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--windows-per-doc", type=int, default=2)
    p.add_argument("--layers", default="all", help="M_S hidden states to store: 'all' or e.g. 0,1,2")
    p.add_argument("--batch-size", type=int, default=4, help="windows per teacher-forced forward")
    p.add_argument("--shard-windows", type=int, default=32)
    p.add_argument("--chat-samples", type=int, default=64, help="chat-* corpora: prompts the large model answers")
    p.add_argument("--chat-max-tokens", type=int, default=96)
    _common(p)
    p.set_defaults(run=_router_data)

    p = sub.add_parser("router-train", help="train a router head over one M_S layer")
    p.add_argument("--data", action="append", required=True, help="router-data dir(s) to (pre)train on")
    p.add_argument("--finetune", action="append", default=[], help="router-data dir(s) of the second stage")
    p.add_argument("--out", required=True, help="head dir (head.safetensors + head.json)")
    p.add_argument("--objective", choices=("binary", "regression", "buckets"), default="binary")
    p.add_argument("--layer", type=int, default=-1, help="M_S hidden state the head reads (-1: last)")
    p.add_argument("--inner-size", type=int, default=512)
    p.add_argument("--features", default="", help="M_S-logit features the head also reads, e.g. entropy,max_prob")
    p.add_argument("--percentile", type=float, default=75.0, help="binary: T_KL at this KL percentile")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--finetune-epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--finetune-lr", type=float, default=3e-4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--val-fraction", type=float, default=0.1)
    _common(p)
    p.set_defaults(run=_router_train)

    p = sub.add_parser("router-calibrate", help="backoff rate -> threshold table of a head, on a calibration set")
    p.add_argument("--head", required=True)
    p.add_argument("--data", action="append", required=True, help="calibration router-data dir(s)")
    p.add_argument("--rates", default=None, help="comma-separated rates (default 0, 0.02, ..., 1)")
    _common(p)
    p.set_defaults(run=_router_calibrate)

    p = sub.add_parser("evaluate", help="the paper's analyses and our goals -> report.md + PNGs")
    model_args(p)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--head", required=True, help="calibrated router head dir")
    p.add_argument("--heldout", action="append", required=True, help="held-out router-data dir(s)")
    p.add_argument("--calib", action="append", default=[], help="calibration router-data dir(s) (fixed thresholds)")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        help="more head dirs (objectives x layers) scored on the held-out data (Fig. 4)",
    )
    p.add_argument(
        "--unseen",
        action="append",
        default=[],
        help="router-data dir(s) of domains the router never saw (KL table, control prompts)",
    )
    p.add_argument("--prompts", type=int, default=64, help="fixed prompt set size for generation quality")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--control-requests", type=int, default=6, help="requests per domain and target")
    p.add_argument("--control-tokens", type=int, default=128)
    p.add_argument(
        "--open-requests", type=int, default=32, help="open-horizon control: chat requests per unseen chat domain"
    )
    p.add_argument("--open-tokens", type=int, default=192, help="open-horizon control: their max_tokens (a cap)")
    p.add_argument("--targets", default="0.5,0.7,0.9")
    p.add_argument(
        "--rate-grid",
        default=None,
        help="generation: calibrated rates each router runs at (with --targets; default 0.3,0.4,...,0.9,0.95), "
        "interpolated to matched achieved rates",
    )
    p.add_argument("--grid-routers", default="oracle,classifier,entropy,random", help="generation: routers on the grid")
    p.add_argument(
        "--skip", action="append", default=[], help="skip a section: layers, generation, speed, control, open_horizon"
    )
    _common(p)
    p.set_defaults(run=_evaluate)

    p = sub.add_parser("evaluate-report", help="redraw every plot and report.md of a run dir from its results.json")
    p.add_argument("--run-dir", required=True, help="a directory holding an evaluate run's results.json")
    p.set_defaults(run=_evaluate_report)

    p = sub.add_parser(
        "evaluate-merge", help="one evaluation from evaluate runs that each skipped some sections (run side by side)"
    )
    p.add_argument("--part", action="append", required=True, help="an evaluate run dir (in order of preference)")
    p.add_argument("--run-dir", required=True, help="where the merged results.json, plots and report.md go")
    p.set_defaults(run=_evaluate_merge)
