"""results.json -> report.md (backoff_core/evaluation/report.py) on a small hand-made results
dict (tests/support/eval_results.py): the goals' verdicts, the head cost, the tables, and
the figures the report names."""

from __future__ import annotations

import pytest

from backoff_core.evaluation.plots import plot_all
from backoff_core.evaluation.report import goals, head_cost, write_report
from tests.support.eval_results import results, with_engine_intervals, with_intervals

FIGURES = ("quality_vs_backoff", "quality_vs_speed", "generation", "high_kl_accuracy", "layers", "control")


def report(res: dict, plots: dict, tmp_path) -> str:
    path = write_report(res, plots, tmp_path)
    assert path == tmp_path / "report.md"
    return path.read_text()


def test_the_report_names_every_figure_it_is_given(tmp_path):
    text = report(results(), {name: f"/elsewhere/{name}.png" for name in FIGURES}, tmp_path)
    for name in FIGURES:
        assert f"![{name}]({name}.png)" in text  # a file name: the PNGs lie beside report.md


def test_the_report_names_the_pngs_plot_all_wrote(tmp_path):
    res = results()
    text = report(res, plot_all(res, tmp_path), tmp_path)
    linked = [name for name in FIGURES if f"]({name}.png)" in text]
    assert linked == list(FIGURES) and all((tmp_path / f"{n}.png").is_file() for n in linked)


def test_a_figure_that_was_not_drawn_is_not_named(tmp_path):
    text = report(results(), {"quality_vs_backoff": tmp_path / "quality_vs_backoff.png"}, tmp_path)
    assert "](quality_vs_backoff.png)" in text and "control.png" not in text and "layers.png" not in text


@pytest.mark.parametrize("gap, verdict", [(0.65, "met"), (0.6, "met"), (0.55, "MISSED")])
def test_the_gap_goal_verdict(gap, verdict):
    line = goals(results(gap=gap))[2]
    assert f"**{gap:.3f}**" in line and line.endswith(f"(goal ≥ 0.60: {verdict}).")


@pytest.mark.parametrize(
    "errors, worst, verdict", [({0.5: 0.01, 0.9: -0.02}, "2.0 points", "met"), ({0.5: 0.04}, "4.0 points", "MISSED")]
)
def test_the_control_goal_takes_the_worst_controller_error(errors, worst, verdict):
    line = next(x for x in goals(results(control_errors=errors)) if "Online control" in x)
    assert f"**{worst}**" in line and f"(goal ≤ 3: {verdict})" in line  # `fixed` rows (2x the error) ignored
    assert "on 2 unseen domains" in line


def test_head_cost_is_the_median_classifier_step_minus_always_small():
    cost = head_cost(results()["speed"])
    assert cost["marginal_s"] == pytest.approx(0.0006 - 0.0002)
    assert cost["c_S_s"] == 0.011 and cost["marginal_ratio"] == pytest.approx(0.0004 / 0.011)


def test_head_cost_goal_line():
    line = next(x for x in goals(results()) if "Router head cost" in x)
    assert "**0.400 ms = 3.6%** of the M_S step (11.00 ms)" in line and "(goal ≤ 5%: met)" in line
    assert "MLP + entropy/max_prob from the step's logits" in line


def test_optional_sections_are_left_out_when_not_measured(tmp_path):
    res = results()
    for key in ("speed", "control", "generation", "compare", "curves_unseen"):
        del res[key]
    text = report(res, {}, tmp_path)
    assert "## Quality vs backoff rate" in text and "## KL(M_L ‖ M_S) buckets" in text
    for gone in (
        "Measured speed",
        "Online rate control",
        "Heads by objective",
        "Generated text",
        "never saw",
        "Router head cost",
    ):
        assert gone not in text


def test_tables_hold_the_measured_numbers(tmp_path):
    text = report(results(), {}, tmp_path)
    assert "| classifier | 2.675 | 0.650 |" in text  # router, area, gap closed
    assert "| stdlib:heldout | 50 | 0.400 | 0.500 | 0.100 | 1.500 | 0.400 |" in text  # KL buckets
    assert "| oracle | KL < 1 | 40.000 | 2.500 | 0.800 |" in text  # backoff in %
    assert "| KL>=5 | 12 | 0.900 | 0.800 | 0.500 |" in text  # high-KL accuracy at b = 0.5, 0.7, 0.9
    assert "| M_L | – | 0.000 |" in text  # None (M_L's target) prints as a dash


def test_gap_closed_lines_carry_their_bootstrap_interval(tmp_path):
    res = with_intervals(results())
    goal = next(x for x in goals(res) if "Gap closed" in x)
    assert "**0.650** (95% CI 0.600–0.700, bootstrap over 30 windows)" in goal
    text = report(res, {}, tmp_path)
    assert "| router | area under NLL(b) | gap closed | 95% CI (30 windows) |" in text
    assert "| classifier | 2.675 | 0.650 | 0.600–0.700 |" in text
    assert "| stdlib:heldout | no | 50 | 4.000 | 2.000 | 0.650 (0.550–0.750) |" in text  # per domain, classifier first


def test_the_nll_oracle_is_named_the_bound_and_its_distance_from_m_l_stated(tmp_path):
    text = report(with_intervals(results()), {}, tmp_path)
    assert "the true upper bound on teacher-forced quality" in text
    line = "At 80% backoff even the NLL oracle reaches NLL 2.600 (KL oracle 2.500, M_L alone 2.000): "
    line += "**+30% NLL over M_L**"
    assert text.count(line) == 2  # in the curves section and beside the paper's Table 2
    assert "| nll_oracle | 2.400 | 1.200 | 1.150–1.250 |" in text


def test_results_without_the_new_keys_report_as_before(tmp_path):
    text = report(results(), {}, tmp_path)
    assert "95% CI" not in text and "nll_oracle" not in text and "over M_L" not in text


def test_open_horizon_control_is_a_goal_line_with_its_quality_cost(tmp_path):
    res = with_engine_intervals(results())
    line = next(x for x in goals(res) if "Open-horizon control" in x)
    assert "worst pooled |achieved − target| **4.0 points** (chat-unix:train, target 0.5) (goal ≤ 3: MISSED)" in line
    assert (
        "fixed calibrated threshold +0.020 to +0.050" in line
        and "random at the controller's rate -0.200 to -0.100" in line
    )
    ctrl = next(x for x in goals(res) if "Online control" in x)
    assert ctrl.endswith("so the controller knows their horizon.")
    text = report(res, {}, tmp_path)
    assert "## Open-horizon control on unseen chat domains" in text
    assert (
        "| chat-unix:train | 0.500 | controller | 0.540 | 4.0 (2.0–6.0) | 6.000 | 0.750 | 220 | 2.000 (1.900–2.100) | 0.020 (0.010–0.030) | -0.100 (-0.110–-0.090) |"
        in text
    )


def test_matched_rates_are_a_goal_line_and_a_table(tmp_path):
    res = with_engine_intervals(results())
    line = next(x for x in goals(res) if "matched rates" in x)
    assert "0.5: -0.100 (-0.150–-0.050)" in line and "0.9" not in line.split("rate:")[1]
    text = report(res, {}, tmp_path)
    assert "| classifier | 0.500 | 1.200 (1.100–1.300) | 0.800 (0.750–0.850) | -0.100 (-0.150–-0.050) |" in text
    assert "| classifier | 0.900 | outside the measured rates | – | – |" in text


def test_the_goal_table_gives_every_domain_with_its_interval_and_whether_m_s_saw_it(tmp_path):
    res = with_intervals(results())
    res["curves_unseen"]["unseen-pydoc/pydoc:train"] = res["curves_unseen"].pop("recipes")
    table = [x for x in goals(res) if x.startswith("| ")]
    assert (
        "| stdlib:heldout | held out | no | 12 | 50 | 0.650 (0.550–0.750) | 0.500 (0.400–0.600) | met (interval spans the goal) |"
        in table
    )
    assert (
        "| unseen-pydoc/pydoc:train | unseen | yes | 12 | 50 | 0.650 (0.550–0.750) | 0.500 (0.400–0.600) | met (interval spans the goal) |"
        in table
    )
