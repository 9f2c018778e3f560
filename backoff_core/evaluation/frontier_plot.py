"""frontier.png: mean accuracy vs backoff rate, and vs one-stream tokens/s (16 streams hollow),
one line per router, M_L alone and M_S alone marked, the packaged default ringed, and the
95%-of-M_L line that a quality-safe default must stay above."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_frontier(frontier: dict, path: Path) -> None:
    fig, (ax_rate, ax_speed) = plt.subplots(1, 2, figsize=(12, 4.8))
    by_router: dict[str, list[dict]] = {}
    for row in frontier["rows"]:
        by_router.setdefault(row["router"], []).append(row)
    large, small, default = frontier["large_alone"], frontier["small_alone"], frontier["default"]
    for router, rows in sorted(by_router.items()):
        rows = sorted(rows, key=lambda r: r["backoff_rate"])
        acc = [r["mean_accuracy"] for r in rows]
        (line,) = ax_rate.plot([r["backoff_rate"] for r in rows], acc, "o-", label=router)
        for r in rows:
            ax_rate.annotate(f"{r['setting']:g}", (r["backoff_rate"], r["mean_accuracy"]), fontsize=7, alpha=0.7)
        by_speed = sorted(rows, key=lambda r: r["tok_per_s"]["1"])
        ax_speed.plot(
            [r["tok_per_s"]["1"] for r in by_speed],
            [r["mean_accuracy"] for r in by_speed],
            "o-",
            color=line.get_color(),
        )
        ax_speed.plot(
            [r["tok_per_s"]["16"] for r in by_speed],
            [r["mean_accuracy"] for r in by_speed],
            "o--",
            color=line.get_color(),
            mfc="none",
            alpha=0.6,
        )
    for ax in (ax_rate, ax_speed):
        ax.axhline(0.95 * large["mean_accuracy"], color="grey", ls=":", lw=1, label="95% of M_L alone")
    ax_rate.plot([large["backoff_rate"]], [large["mean_accuracy"]], "k*", ms=14, label="M_L alone")
    ax_rate.plot([small["backoff_rate"]], [small["mean_accuracy"]], "kX", ms=11, label="M_S alone")
    ax_rate.plot(
        [default["backoff_rate"]], [default["mean_accuracy"]], "o", ms=16, mfc="none", mec="k", label="default"
    )
    for streams, style in (("1", {}), ("16", {"mfc": "none"})):
        ax_speed.plot([large["tok_per_s"][streams]], [large["mean_accuracy"]], "k*", ms=14, **style)
        ax_speed.plot([small["tok_per_s"][streams]], [small["mean_accuracy"]], "kX", ms=11, **style)
    chosen = next(
        (r for r in frontier["rows"] if r["router"] == default["router"] and r["setting"] == default["setting"]), None
    )
    if chosen is not None:
        ax_speed.plot([chosen["tok_per_s"]["1"]], [chosen["mean_accuracy"]], "o", ms=16, mfc="none", mec="k")
    ax_rate.set(xlabel="backoff rate (share on M_S)", ylabel="mean accuracy over the tasks", title=frontier["pair"])
    ax_speed.set(xlabel="tokens/s (filled: 1 stream, hollow: 16 streams)", ylabel="mean accuracy", xscale="log")
    ax_rate.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
