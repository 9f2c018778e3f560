"""The router head's training curves (backoff_core/learning/plots.py) as a PNG, and
save_figure, which every plot of the project goes through."""

from __future__ import annotations

import matplotlib.pyplot as plt

from backoff_core.learning import plots
from backoff_core.learning.plots import plot_training, save_figure

PNG = b"\x89PNG\r\n\x1a\n"


def epoch(stage: str, loss: float, train_loss: float | None) -> dict:
    return {
        "stage": stage,
        "epoch": 0,
        "loss": loss,
        "train_loss": train_loss,
        "gap_closed": 1 - loss,
        "auc_high_kl": 0.5 + loss / 4,
    }


def test_training_curves_become_a_png(tmp_path):
    log = [epoch("pretrain", 1.0, None), epoch("pretrain", 0.8, 0.9), epoch("finetune", 0.7, 0.75)]
    path = plot_training(log, tmp_path / "train_curve.png")
    assert path == tmp_path / "train_curve.png" and path.read_bytes()[:8] == PNG
    assert plt.get_fignums() == []


def test_the_stage_change_is_marked_once(tmp_path, monkeypatch):
    log = [epoch("pretrain", 1.0, 0.9), epoch("pretrain", 0.8, 0.8), epoch("finetune", 0.7, 0.7)]
    drawn = []

    def keep(fig, path):  # what each panel holds, just before the figure is saved
        drawn.extend([list(line.get_xdata()) for line in ax.get_lines()] for ax in fig.axes)
        return save_figure(fig, path)

    monkeypatch.setattr(plots, "save_figure", keep)
    plots.plot_training(log, tmp_path / "curve.png")
    assert len(drawn) == 2
    for lines in drawn:  # two curves per panel, then one vertical line between epochs 1 and 2
        assert len(lines) == 3 and lines[2] == [1.5, 1.5]


def test_save_figure_writes_and_closes(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    assert save_figure(fig, tmp_path / "f.png") == tmp_path / "f.png"
    assert (tmp_path / "f.png").read_bytes()[:8] == PNG and not plt.fignum_exists(fig.number)
