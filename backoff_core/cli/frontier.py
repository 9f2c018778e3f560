"""`backoff frontier` (accuracy vs backoff rate vs tokens/s) and `backoff lm-eval` (lm-eval's
own CLI with the `backoff` model type registered). Both need the eval extra (lm-eval)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from backoff_core.cli.args import load_spec, model_args
from backoff_core.evaluation.frontier_spec import CLASSIFIER_RATES, DEFAULT_GRID, TASKS, tasks_dir

NEED_EXTRA = "lm-eval is not installed: pip install -e '.[eval]' (the eval extra)"


def register(sub) -> None:
    p = sub.add_parser(
        "frontier",
        help="accuracy vs backoff rate vs tokens/s on a task set, per router and setting (lm-eval)",
        description="Runs the task set through the `backoff` lm-eval model for each (router, setting), "
        "plus M_L alone and M_S alone, and writes frontier.json and frontier.png. Rows are cached "
        "as they finish: run the same command again to resume.",
    )
    model_args(p)
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="ROUTER=T1,T2,...",
        help="a router and its thresholds (random: backoff rates), repeatable; classifier=rate:0.2,0.4 "
        "takes the head's calibrated thresholds for those rates. Default: "
        + "; ".join(f"{r}={','.join(f'{t:g}' for t in ts)}" for r, ts in DEFAULT_GRID.items())
        + f"; classifier=rate:{','.join(f'{r:g}' for r in CLASSIFIER_RATES)}",
    )
    p.add_argument("--classifier", default=None, help="router head directory (default: the pair's shipped head)")
    p.add_argument("--tasks", default=",".join(TASKS), help="lm-eval task names (comma-separated)")
    p.add_argument("--include-path", default="", help=f"task folder for lm-eval (default: the packaged {tasks_dir()})")
    p.add_argument("--builtin-tasks", action="store_true", help="also offer lm-eval's own tasks (most need the hub)")
    p.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    p.add_argument("--batch-size", type=int, default=64, help="requests the engine steps together")
    p.add_argument("--speed-tokens", type=int, default=24, help="tokens per stream of the speed workload")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="write frontier.json/png from the rows already cached under this configuration; load no model",
    )
    p.add_argument(
        "--speed-pass",
        action="store_true",
        help="after the rows: measure every cached row's tokens/s again, rows interleaved (a loaded machine)",
    )
    p.add_argument("--out-dir", default="benchmarks/results", help="frontier.json and frontier.png go here")
    p.add_argument("--cache-dir", default=None, help="one file per finished row (default: OUT_DIR/frontier_rows)")
    p.set_defaults(run=_frontier)


def _settings(grid: list[str], engine):
    from backoff_core.evaluation.frontier import Setting

    specs = grid or [f"{r}={','.join(map(str, ts))}" for r, ts in DEFAULT_GRID.items()] + [
        "classifier=rate:" + ",".join(map(str, CLASSIFIER_RATES))
    ]
    settings = []
    for spec in specs:
        router, _, values = spec.partition("=")
        if not router or not values:
            raise ValueError(f"--grid wants ROUTER=T1,T2,..., got {spec!r}")
        if values.startswith("rate:"):  # the classifier's calibrated thresholds for these backoff rates
            from backoff_core.routing.routers import build_router

            head = build_router(router, classifier_path=engine.classifier_path, hidden_size=engine.hidden_size).head
            thresholds = [round(head.threshold_for_rate(float(v)), 4) for v in values[5:].split(",")]
        else:
            thresholds = [float(v) for v in values.split(",")]
        settings += [Setting(router.strip(), t) for t in thresholds]
    return settings


def _model_files(args) -> list:
    """What the rows are measured with, for the cache's fingerprint: the models' files (the
    embedded pair's student, its GGUF)."""
    from backoff_core.models.default_pair import STUDENT_CONFIG, STUDENT_DIR, STUDENT_WEIGHTS, find_large_gguf

    small = [args.small] if args.small else [STUDENT_DIR / STUDENT_CONFIG, STUDENT_DIR / STUDENT_WEIGHTS]
    return [*small, *(args.medium or []), args.large or find_large_gguf()]


def _head_files(args) -> list:
    """The router head the classifier rows use (named, or the embedded pair's)."""
    from backoff_core.models.default_pair import DEFAULT_HEAD_DIR

    head = args.classifier or (DEFAULT_HEAD_DIR if not (args.small or args.large) else None)
    return [head] if head else []


def _frontier(args) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print(f"backoff frontier: {NEED_EXTRA}", file=sys.stderr)
        return 2
    from backoff_core.engine.engine import BackoffEngine
    from backoff_core.evaluation.frontier import (
        FrontierConfig,
        best_kept,
        cached_rows,
        files_digest,
        markdown_table,
        remeasure_speed,
        run_frontier,
    )
    from backoff_core.evaluation.frontier_plot import plot_frontier
    from backoff_core.models.default_pair import DEFAULT_PAIR_NAMES
    from backoff_core.models.loading import chain_names, load_chain

    names = chain_names(args.small, args.large, args.medium) or DEFAULT_PAIR_NAMES
    config = FrontierConfig(
        pair="+".join(_quantized_names(names, args)),
        models=files_digest(_model_files(args)),
        head=files_digest(_head_files(args)),
        tasks=tuple(t for t in args.tasks.split(",") if t),
        include_path=args.include_path,
        builtin_tasks=args.builtin_tasks,
        limit=args.limit,
        batch_size=args.batch_size,
        speed_tokens=args.speed_tokens,
    )
    out = Path(args.out_dir)
    cache_dir = Path(args.cache_dir or out / "frontier_rows")
    if args.report_only:
        frontier = cached_rows(config, cache_dir)
    else:
        chain = load_chain(args.small, args.large, args.medium, load_spec(args))
        engine = BackoffEngine.from_chain(chain, classifier_path=args.classifier)
        frontier = run_frontier(engine, _settings(args.grid, engine), config, cache_dir)
        if args.speed_pass:
            remeasure_speed(engine, config, cache_dir)
            frontier = cached_rows(config, cache_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(frontier, indent=1) + "\n")
    plot_frontier(frontier, out / "frontier.png")
    d, best = frontier["default"], best_kept(frontier)
    print(markdown_table(frontier))
    print(f"wrote {out / 'frontier.json'} and {out / 'frontier.png'}")
    print(
        f"M_L alone {frontier['large_alone']['mean_accuracy']:.3f}, M_S alone {frontier['small_alone']['mean_accuracy']:.3f}; "
        f"default {d['router']} {d['setting']}: accuracy {d['mean_accuracy']:.3f} "
        f"({d['accuracy_ratio']:.2f} of M_L), backoff {d['backoff_rate']:.2f}, {d['speedup_vs_large']:.2f}x M_L's tok/s"
    )
    if best is not None:
        print(
            f"fastest keeping >= 95% of M_L: {best['router']} {best['setting']} (accuracy {best['mean_accuracy']:.3f}, "
            f"backoff {best['backoff_rate']:.2f}, {best['tok_per_s']['1']:.1f} tok/s)"
        )
    return 0


def _quantized_names(names: tuple[str, ...], args) -> list[str]:
    """The chain's names, an fp8 model's marked `:fp8`: its rows are not the full model's."""
    marks = [args.quantize_small, *["none"] * (len(names) - 2), args.quantize_large]
    return [name if mark == "none" else f"{name}:{mark}" for name, mark in zip(names, marks)]


def lm_eval_main(argv: list[str]) -> int:
    """`backoff lm-eval ARGS`: lm-eval's own CLI (ARGS as `lm_eval` takes them) with the model
    type `backoff` registered; the packaged task folder is added to --include_path. lm-eval
    0.4.13 has no plug-in entry point for model types, so the stock `lm_eval` cannot know it."""
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging
    except ImportError:
        print(f"backoff lm-eval: {NEED_EXTRA}", file=sys.stderr)
        return 2
    import backoff_core.evaluation.lm_model  # noqa: F401 - registers --model backoff

    try:
        argv = quantize_into_model_args(list(argv))
    except ValueError as exc:
        print(f"backoff lm-eval: {exc}", file=sys.stderr)
        return 2
    if argv and argv[0] not in ("-h", "--help") and "--include_path" not in argv:
        argv += ["--include_path", str(tasks_dir())]
    if _model_of(argv) == "backoff" and not any(
        a in ("--batch_size", "-b") or a.startswith("--batch_size=") for a in argv
    ):
        argv += ["--batch_size", "32"]  # lm-eval's CLI default of 1 would step the engine one request at a time
    saved = sys.argv
    sys.argv = ["lm_eval", *argv]
    try:
        setup_logging()
        parser = HarnessCLI()
        parser.execute(parser.parse_args())
    finally:
        sys.argv = saved
    return 0


def quantize_into_model_args(argv: list[str]) -> list[str]:
    """`--quantize-small / --quantize-large fp8` (ours, not lm-eval's) taken out of argv and
    passed as the backoff model's model_args quantize_small= / quantize_large=."""
    from backoff_core.cli.args import QUANTIZE_CHOICES

    rest, extra = [], []
    it = iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag not in ("--quantize-small", "--quantize-large"):
            rest.append(arg)
            continue
        value = value if eq else next(it, "")
        if value not in QUANTIZE_CHOICES:
            raise ValueError(f"{flag} must be one of {', '.join(QUANTIZE_CHOICES)}, got {value!r}")
        extra.append(f"{flag[2:].replace('-', '_')}={value}")
    if not extra:
        return rest
    for i, arg in enumerate(rest):
        if arg == "--model_args" and i + 1 < len(rest):
            rest[i + 1] = ",".join([rest[i + 1], *extra]) if rest[i + 1] else ",".join(extra)
            return rest
        if arg.startswith("--model_args="):
            rest[i] = ",".join([arg, *extra]) if arg != "--model_args=" else arg + ",".join(extra)
            return rest
    return [*rest, "--model_args", ",".join(extra)]


def _model_of(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
        if arg == "--model" and i + 1 < len(argv):
            return argv[i + 1]
    return None
