"""Every curve of the router work as a PNG (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from backoff_core.learning.plots import save_figure

COLOURS = {
    "oracle": "black",
    "classifier": "tab:blue",
    "entropy": "tab:orange",
    "max-prob": "tab:green",
    "random": "tab:gray",
    "flipped-oracle": "tab:red",
    "nll_oracle": "tab:purple",
}
DASHES = {"flipped-oracle": "--", "nll_oracle": "-."}  # hindsight rules, not routers one could run


def plot_quality_vs_backoff(res: dict, path: Path) -> Path:
    c = res["curves"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, r in c["routers"].items():
        ax.plot(
            c["rates"],
            r["curve"],
            label=f"{name} (gap closed {r['gap_closed']:.2f})",
            color=COLOURS.get(name),
            ls=DASHES.get(name, "-"),
        )
    ax.axhline(c["nll_large"], color="gray", ls=":", lw=0.8)
    ax.axhline(c["nll_small"], color="gray", ls=":", lw=0.8)
    ax.set_xlabel("backoff rate (share of tokens from M_S)")
    ax.set_ylabel("NLL of held-out text (nats/token)")
    ax.set_title(f"Routed mixture, teacher-forced ({c['positions']} positions)")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_quality_vs_speed(res: dict, path: Path) -> Path | None:
    sp = res.get("speed")
    if not sp:
        return None
    pts = sorted((r["backoff_rate"], r["tokens_per_s"]) for r in sp["runs"])
    rates, speeds = [p[0] for p in pts], [p[1] for p in pts]

    def speed_at(b: float) -> float:  # piecewise-linear in the measured backoff rate
        for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
            if b0 <= b <= b1:
                return s0 + (s1 - s0) * (b - b0) / (b1 - b0) if b1 > b0 else s1
        return speeds[0] if b < rates[0] else speeds[-1]

    c = res["curves"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(rates, speeds, "o-")
    axes[0].set_xlabel("achieved backoff rate")
    axes[0].set_ylabel("decode tokens/s (measured)")
    axes[0].set_title("Measured speed (classifier router, CPU)")
    for name, r in c["routers"].items():
        if name == "flipped-oracle":
            continue
        axes[1].plot([speed_at(b) for b in c["rates"]], r["curve"], label=name, color=COLOURS.get(name))
    axes[1].set_xlabel("tokens/s at that backoff rate (classifier's measured speed)")
    axes[1].set_ylabel("NLL of held-out text")
    axes[1].set_title("Quality vs speed (oracle: speed it would have)")
    axes[1].legend(fontsize=8)
    return save_figure(fig, path)


def plot_generation(res: dict, path: Path) -> Path | None:
    g = res.get("generation")
    if not g:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    refs = {r["label"]: r for r in g["runs"] if r["label"] in ("M_L", "M_S")}
    for name in ("oracle", "classifier", "entropy", "random"):
        rows = sorted((r for r in g["runs"] if r["label"].startswith(name + "@")), key=lambda r: r["backoff_rate"])
        if rows:
            for ax, key in zip(axes, ("large_nll", "agreement")):
                ax.plot(
                    [r["backoff_rate"] for r in rows], [r[key] for r in rows], "o-", label=name, color=COLOURS[name]
                )
        for t, e in ((g.get("matched") or {}).get("routers", {}).get(name) or {}).items():
            if e is not None:  # the matched-rate point with its 95% interval over prompts
                for ax, key in zip(axes, ("large_nll", "agreement")):
                    lo, hi = e[f"ci95_{'nll' if key == 'large_nll' else key}"] or (e[key], e[key])
                    ax.errorbar(float(t), e[key], yerr=[[e[key] - lo], [hi - e[key]]], color=COLOURS[name], capsize=3)
    for ax, key, label in zip(
        axes, ("large_nll", "agreement"), ("M_L NLL of generated text", "greedy agreement with M_L")
    ):
        for ref, r in refs.items():
            ax.axhline(r[key], color="gray", ls=":", lw=0.8)
            ax.annotate(ref, (0.01, r[key]), fontsize=7)
        ax.set_xlabel("achieved backoff rate")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"Generated text, {g['prompts']} held-out prompts × {g['max_tokens']} tokens (greedy)")
    return save_figure(fig, path)


def plot_high_kl(res: dict, path: Path) -> Path | None:
    # the shipped head, then the paper-like heads (hidden state only) of each objective on its layer
    main = res["head"]
    rows = [{"objective": main["objective"], "features": main.get("features"), "high_kl": res["high_kl"]}]
    rows += sorted(
        (r for r in res.get("compare", []) if r["layer"] == main["layer"] and not r.get("features")),
        key=lambda r: r["objective"],
    )
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.6), squeeze=False)
    for ax, r in zip(axes[0], rows):
        hk = r["high_kl"]
        for g, v in hk["groups"].items():
            ax.plot(hk["rates"], v["accuracy"], label=f"{g} (n={v['count']})")
        ax.set_title(f"{r['objective']} head" + (" + logit features" if r.get("features") else ""))
        ax.set_xlabel("backoff rate")
        ax.set_ylabel("share routed to M_L (accuracy)")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_layers(res: dict, path: Path) -> Path | None:
    rows = res.get("compare", [])
    if len({r["layer"] for r in rows}) < 2:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    # the paper's sweep (hidden state only, one head per layer) as lines; other heads as points
    sweep = [r for r in rows if not r.get("features")]
    for objective in sorted({r["objective"] for r in sweep}):
        pts = sorted({r["layer"]: r["gap_closed"] for r in sweep if r["objective"] == objective}.items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{objective} (hidden state only)")
    others = [r for r in rows if r.get("features")]
    for i, r in enumerate(sorted(others, key=lambda r: r["head"])):
        ax.plot([r["layer"] + 0.04 * (i + 1)], [r["gap_closed"]], marker="*", ls="none", label=Path(r["head"]).name)
    ax.set_xlabel("M_S hidden state the head reads (0 = embeddings)")
    ax.set_ylabel("gap closed on held-out text")
    ax.set_xticks(sorted({r["layer"] for r in rows}))
    ax.legend(fontsize=6)
    return save_figure(fig, path)


def plot_control(res: dict, path: Path) -> Path | None:
    rows = res.get("control")
    if not rows:
        return None
    domains = sorted({r["domain"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, d in enumerate(domains):
        for mode, marker in (("controller", "o"), ("fixed", "x")):
            pts = sorted((r["target"], r["pooled"]) for r in rows if r["domain"] == d and r["mode"] == mode)
            axes[0].plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker=marker,
                ls="-" if mode == "controller" else ":",
                color=f"C{i}",
                label=f"{d} ({mode})",
            )
    lo, hi = 0.4, 1.0
    axes[0].plot([lo, hi], [lo, hi], color="gray", lw=0.8)
    axes[0].fill_between([lo, hi], [lo - 0.03, hi - 0.03], [lo + 0.03, hi + 0.03], color="gray", alpha=0.15)
    axes[0].set_xlabel("target backoff rate")
    axes[0].set_ylabel("achieved (pooled over requests)")
    axes[0].legend(fontsize=7)
    colour = {t: f"C{i}" for i, t in enumerate(sorted({r["target"] for r in rows}))}
    for r in rows:
        if r["mode"] == "controller" and r["domain"] == domains[0]:
            for j, traj in enumerate(r["trajectories"]):
                axes[1].plot(
                    range(1, len(traj) + 1),
                    traj,
                    color=colour[r["target"]],
                    lw=0.8,
                    label=f"target {r['target']}" if j == 0 else None,
                )
            axes[1].axhline(r["target"], color="gray", ls=":", lw=0.8)
    axes[1].set_xlabel("generated tokens")
    axes[1].set_ylabel("running backoff rate")
    axes[1].set_title(f"controller, {domains[0]} (3 requests per target)")
    axes[1].legend(fontsize=8)
    return save_figure(fig, path)


# every figure of a run: its file stem -> the function that draws it (None: not measured)
PLOTS = {
    "quality_vs_backoff": plot_quality_vs_backoff,
    "quality_vs_speed": plot_quality_vs_speed,
    "generation": plot_generation,
    "high_kl_accuracy": plot_high_kl,
    "layers": plot_layers,
    "control": plot_control,
}


def plot_all(res: dict, run_dir: Path) -> dict[str, Path]:
    out = {}
    for name, fn in PLOTS.items():
        p = fn(res, Path(run_dir) / f"{name}.png")
        if p is not None:
            out[name] = p
    return out
