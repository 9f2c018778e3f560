"""`backoff evaluate-report`: every plot and the report of a run again from its results.json
alone (evaluate.rewrite), checked against the committed evaluation of the default pair."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

COMMITTED = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "router_eval"


def _report_images(report: Path) -> set[str]:
    return set(re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report.read_text()))


@pytest.fixture(scope="module")
def redrawn(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("router_eval")
    shutil.copy(COMMITTED / "results.json", run_dir / "results.json")
    out = subprocess.run(
        [sys.executable, "-m", "backoff_core.cli.main", "evaluate-report", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return run_dir


def test_one_command_redraws_every_figure_the_report_shows(redrawn):
    drawn = {p.name for p in redrawn.glob("*.png")}
    assert drawn == _report_images(redrawn / "report.md") and len(drawn) == 6


def test_the_committed_evaluation_is_what_its_results_json_draws(redrawn):
    # a committed PNG no figure draws any more (a stale plot) or a report edited by hand fails here
    assert {p.name for p in COMMITTED.glob("*.png")} == {p.name for p in redrawn.glob("*.png")}
    assert (COMMITTED / "report.md").read_text() == (redrawn / "report.md").read_text()


def test_the_committed_teacher_forced_evaluation_is_what_its_results_json_draws(tmp_path):
    """benchmarks/results/router_eval_tf: the shipped head on the 5-layer M_S, the teacher-forced
    part alone (the other sections skipped): two figures, and nothing edited by hand."""
    committed = COMMITTED.with_name("router_eval_tf")
    shutil.copy(committed / "results.json", tmp_path / "results.json")
    from backoff_core.evaluation.evaluate import rewrite

    rewrite(tmp_path)
    assert {p.name for p in committed.glob("*.png")} == {p.name for p in tmp_path.glob("*.png")}
    assert {p.name for p in tmp_path.glob("*.png")} == _report_images(tmp_path / "report.md")
    assert (committed / "report.md").read_text() == (tmp_path / "report.md").read_text()


def test_a_figure_no_longer_measured_leaves_no_stale_png(tmp_path):
    from backoff_core.evaluation.evaluate import rewrite

    res = json.loads((COMMITTED / "results.json").read_text())
    res.pop("control")  # a run that skipped the control section
    (tmp_path / "results.json").write_text(json.dumps(res))
    (tmp_path / "control.png").write_bytes(b"an earlier run's figure")
    rewrite(tmp_path)
    assert not (tmp_path / "control.png").exists()
    assert "control.png" not in _report_images(tmp_path / "report.md")


@pytest.fixture
def synthetic_curves(monkeypatch) -> dict:
    import torch

    from backoff_core.evaluation import evaluate
    from tests.support.router_fakes import synthetic

    data = synthetic(n=1200, seed=1)  # 60 windows of 20 positions
    noise = torch.randn(len(data), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(evaluate, "head_scores", lambda head, d: d.kl + noise[: len(d)])  # a fake head
    return evaluate.curves(head=None, data=data, n_boot=200)


def test_curves_hold_the_nll_oracle_below_every_router(synthetic_curves):
    routers = synthetic_curves["routers"]
    best = routers["nll_oracle"]["curve"]
    for name, r in routers.items():
        assert all(b <= x + 1e-5 for b, x in zip(best, r["curve"])), name
    assert routers["oracle"]["gap_closed"] == pytest.approx(1.0) and routers["nll_oracle"]["gap_closed"] >= 1.0


def test_curves_store_a_bootstrap_interval_beside_each_gap_closed(synthetic_curves):
    from backoff_core.evaluation.evaluate import _gaps

    assert synthetic_curves["windows"] == 60 and synthetic_curves["documents"] == 30  # two windows a document
    for name, r in synthetic_curves["routers"].items():
        lo, hi = r["ci95"]
        assert lo <= r["gap_closed"] <= hi, name
    assert synthetic_curves["routers"]["oracle"]["ci95"] == pytest.approx([1.0, 1.0])  # the reference itself
    assert synthetic_curves["routers"]["classifier"]["ci95"][1] > synthetic_curves["routers"]["classifier"]["ci95"][0]
    gaps = _gaps(synthetic_curves)
    assert gaps["ci95"]["classifier"] == synthetic_curves["routers"]["classifier"]["ci95"] and gaps["documents"] == 30


def _part(tmp_path, name: str, skip: list[str], mark: str) -> str:
    from tests.support.eval_results import results

    res = results()
    res["config"] = {"run_dir": name, "skip": skip}
    res["open_horizon"] = []
    for key in ("generation", "control", "speed", "compare", "open_horizon"):
        res[key] = {"from": mark} if key not in ("compare", "control", "open_horizon") else res[key]
    res["control"] = [dict(r, domain=mark) for r in res["control"]]
    (tmp_path / name).mkdir()
    (tmp_path / name / "results.json").write_text(json.dumps(res))
    return str(tmp_path / name)


def test_merge_takes_each_section_from_the_part_that_ran_it(tmp_path, monkeypatch):
    from backoff_core.evaluation import evaluate

    monkeypatch.setattr(evaluate, "rewrite", lambda run_dir: Path(run_dir) / "report.md")
    a = _part(tmp_path, "a", ["control", "open_horizon", "speed"], "a")
    b = _part(tmp_path, "b", ["generation", "layers", "open_horizon"], "b")
    evaluate.merge([a, b], tmp_path / "m")
    m = json.loads((tmp_path / "m" / "results.json").read_text())
    assert m["generation"] == {"from": "a"} and m["speed"] == {"from": "b"}
    assert {r["domain"] for r in m["control"]} == {"b"} and "open_horizon" not in m  # no part ran it
    assert m["config"]["skip"] == ["open_horizon"] and [p["run_dir"] for p in m["config"]["parts"]] == ["a", "b"]


def test_merge_refuses_parts_of_different_evaluations(tmp_path):
    from backoff_core.evaluation.evaluate import merge

    a = _part(tmp_path, "a", [], "a")
    b = _part(tmp_path, "b", [], "b")
    res = json.loads((Path(b) / "results.json").read_text())
    res["curves"]["routers"]["classifier"]["gap_closed"] = 0.1
    (Path(b) / "results.json").write_text(json.dumps(res))
    with pytest.raises(ValueError, match="another evaluation"):
        merge([a, b], tmp_path / "m")
