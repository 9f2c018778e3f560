"""Every curve of backoff_core/evaluation/plots.py becomes a PNG (headless) from a small
hand-made results dict; a section that was not measured draws nothing."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from backoff_core.evaluation import plots
from tests.support.eval_results import results, with_intervals

PNG = b"\x89PNG\r\n\x1a\n"
DRAW = {
    "quality_vs_backoff": plots.plot_quality_vs_backoff,
    "quality_vs_speed": plots.plot_quality_vs_speed,
    "generation": plots.plot_generation,
    "high_kl_accuracy": plots.plot_high_kl,
    "layers": plots.plot_layers,
    "control": plots.plot_control,
}


def is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG and path.stat().st_size > 1000


@pytest.mark.parametrize("name", list(DRAW))
def test_every_plot_writes_a_png_and_closes_its_figure(tmp_path, name):
    path = tmp_path / f"{name}.png"
    assert DRAW[name](results(), path) == path and is_png(path)
    assert plt.get_fignums() == []  # a long evaluation must not keep every figure open


@pytest.mark.parametrize(
    "name, section",
    [("quality_vs_speed", "speed"), ("generation", "generation"), ("layers", "compare"), ("control", "control")],
)
def test_a_section_not_measured_draws_nothing(tmp_path, name, section):
    res = results()
    del res[section]
    assert DRAW[name](res, tmp_path / "x.png") is None and not (tmp_path / "x.png").exists()


def test_a_single_layer_draws_no_layer_plot(tmp_path):
    res = results()
    res["compare"] = [r for r in res["compare"] if r["layer"] == 2]
    assert plots.plot_layers(res, tmp_path / "layers.png") is None


def test_the_high_kl_plot_needs_no_comparison_heads(tmp_path):
    res = results()
    del res["compare"]
    assert is_png(plots.plot_high_kl(res, tmp_path / "h.png"))


def test_plot_all_returns_the_pngs_it_wrote(tmp_path):
    out = plots.plot_all(results(), tmp_path)
    assert out == {name: tmp_path / f"{name}.png" for name in DRAW} and all(is_png(p) for p in out.values())
    res = results()
    del res["control"], res["speed"]
    (tmp_path / "partial").mkdir()
    assert sorted(plots.plot_all(res, tmp_path / "partial")) == sorted(set(DRAW) - {"control", "quality_vs_speed"})


def test_the_nll_oracle_is_a_line_of_the_quality_plot(tmp_path, monkeypatch):
    drawn = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.setdefault("fig", fig) and path)
    plots.plot_quality_vs_backoff(with_intervals(results()), tmp_path / "q.png")
    lines = {line.get_label(): line for line in drawn["fig"].axes[0].get_lines()}
    assert lines["nll_oracle (gap closed 1.20)"].get_ydata().tolist() == [2.0, 2.6, 4.0]
    plt.close(drawn["fig"])
