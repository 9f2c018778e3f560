"""batch_scaling.py's report: the results file's figures, the tables printed, the plot."""

from __future__ import annotations

from pathlib import Path


def results(args, kv, load_s: float, waits: dict, streams: list[int], runs: dict, errors: dict, gpu) -> dict:
    """The results file's figures (runs, errors: measure's, so far)."""

    def pick(key: str) -> dict[str, dict[str, float]]:
        return {label: {n: figures[key] for n, figures in row.items()} for label, row in runs.items()}

    table = pick("tok_per_s")
    base = str(streams[0])
    report = {
        "device": args.device,
        "gpu": gpu,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "repeats_one": getattr(args, "repeats_one", args.repeats),  # at one stream
        "kv": None
        if kv is None
        else {"budget_tokens": kv.budget_tokens, "max_len": kv.max_len, "cuda_graphs": kv.cuda_graphs},
        "engine_load_s": load_s,
        "catch_up_wait_ms": waits,
        "tok_per_s": table,
        "routed_share": pick("routed_share"),  # the realised share of tokens a larger model gave
        "catch_up_forwards_per_100_tokens": pick("forwards_per_100_tokens"),
        "itl_median_ms": pick("itl_median_ms"),
        "itl_p99_ms": pick("itl_p99_ms"),
        "scaling_vs_n1": {label: {n: v / row[base] for n, v in row.items()} for label, row in table.items()},
        "errors": errors,
    }
    return report


def print_report(report, streams) -> None:
    """The tables: tok/s (and 64 vs 1), M_L forwards per 100 tokens, inter-token latency."""
    for label, error in report["errors"].items():
        print(f"{label}: not measured ({error})")
    print(f"\n{'routing':32s} " + " ".join(f"{'n=' + str(n):>10s}" for n in streams) + "   (tok/s; x n=1)")
    for label, row in report["tok_per_s"].items():
        cells = " ".join(f"{row[str(n)]:10.1f}" for n in streams)
        print(f"{label:32s} {cells}   x{report['scaling_vs_n1'][label][str(streams[-1])]:.1f}")
    print(f"\n{'catch-up forwards / 100 tokens':32s} " + " ".join(f"{'n=' + str(n):>10s}" for n in streams))
    for label, row in report["catch_up_forwards_per_100_tokens"].items():
        print(f"{label:32s} " + " ".join(f"{row[str(n)]:10.1f}" for n in streams))
    print(f"\n{'inter-token ms, median / p99':32s} " + " ".join(f"{'n=' + str(n):>10s}" for n in streams))
    for label, row in report["itl_median_ms"].items():
        p99 = report["itl_p99_ms"][label]
        print(f"{label:32s} " + " ".join(f"{f'{row[str(n)]:.0f}/{p99[str(n)]:.0f}':>10s}" for n in streams))


def plot_report(report, streams, path: Path) -> None:
    title = f"Batch scaling ({report['gpu'] or report['device']}, {report['dtype']})"
    plot_scaling(report["tok_per_s"], streams, path, "aggregate tokens / s (median)", title)


def plot_scaling(tok_per_s: dict, streams: list[int], path: Path, ylabel: str, title: str) -> None:
    """tok/s against n, a line per routing, log-log (gpu_sim.py draws its table the same way)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, row in tok_per_s.items():
        ax.plot(streams, [row[str(n)] for n in streams], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests n")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
