"""The router head's training curves as a PNG (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_training(log: list[dict], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    x = list(range(len(log)))
    axes[0].plot(x, [r["loss"] for r in log], label="held-out loss")
    axes[0].plot(x, [r["train_loss"] if r["train_loss"] is not None else float("nan") for r in log], label="train loss")
    axes[1].plot(x, [r["gap_closed"] for r in log], label="held-out gap closed")
    axes[1].plot(x, [r["auc_high_kl"] for r in log], label="held-out AUC (KL > T_KL)")
    for ax in axes:
        for i in range(1, len(log)):
            if log[i]["stage"] != log[i - 1]["stage"]:
                ax.axvline(i - 0.5, color="gray", ls=":")
        ax.set_xlabel("epoch (pretrain | finetune)")
        ax.legend(fontsize=8)
    return save_figure(fig, path)
