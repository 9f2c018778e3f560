"""The router pipeline end to end through the `backoff` CLI, on tiny models saved to a
tmp dir: router-data -> router-train -> router-calibrate -> evaluate."""

from __future__ import annotations

import json

import pytest

from backoff_core.cli.main import main
from tests.support.corpus import write_corpus
from tests.support.router_fakes import one_thread  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def models(tmp_path_factory, pair, tokenizer):
    root = tmp_path_factory.mktemp("models")
    for name, model in zip(("small", "large"), pair):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return ["--small", str(root / "small"), "--large", str(root / "large"), "--threads", "1"]


def test_pipeline_end_to_end(tmp_path, models, capsys):
    texts, chat = write_corpus(tmp_path / "a", seed=0, docs=6, chats=6)
    other, other_chat = write_corpus(tmp_path / "b", seed=1, docs=3, chats=3)
    data = lambda name, *corpora: main(
        [
            "router-data",
            *models,
            "--out",
            str(tmp_path / name),
            "--seq-len",
            "64",  # noqa: E731
            "--max-positions",
            "500",
            *[x for c in corpora for x in ("--corpus", c)],
        ]
    )
    assert data("train", texts) == 0
    assert data("fine", chat) == 0
    assert data("calib", texts, chat) == 0
    assert data("heldout", texts, chat) == 0
    assert data("unseen", other) == 0
    assert data("unseen-chat", other_chat) == 0
    head = str(tmp_path / "head")
    assert (
        main(
            [
                "router-train",
                "--data",
                str(tmp_path / "train"),
                "--finetune",
                str(tmp_path / "fine"),
                "--out",
                head,
                "--objective",
                "regression",
                "--inner-size",
                "16",
                "--epochs",
                "2",
                "--finetune-epochs",
                "1",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert main(["router-calibrate", "--head", head, "--data", str(tmp_path / "calib"), "--threads", "1"]) == 0
    meta = json.loads((tmp_path / "head" / "head.json").read_text())
    assert meta["objective"] == "regression" and len(meta["calibration"]) == 51
    run = tmp_path / "run"
    assert (
        main(
            [
                "evaluate",
                *models,
                "--run-dir",
                str(run),
                "--head",
                head,
                "--heldout",
                str(tmp_path / "heldout"),
                "--calib",
                str(tmp_path / "calib"),
                "--unseen",
                str(tmp_path / "unseen"),
                "--unseen",
                str(tmp_path / "unseen-chat"),
                "--compare",
                head,
                "--prompts",
                "2",
                "--max-tokens",
                "6",
                "--control-requests",
                "2",
                "--control-tokens",
                "10",
                "--open-requests",
                "3",
                "--open-tokens",
                "8",
            ]
        )
        == 0
    )
    report = (run / "report.md").read_text()
    for section in (
        "## Goals",
        "paper Table 1",
        "paper Table 2",
        "paper Figure 3",
        "Online rate control",
        "Measured speed",
    ):
        assert section in report
    for png in ("quality_vs_backoff", "quality_vs_speed", "generation", "high_kl_accuracy", "control"):
        assert (run / f"{png}.png").stat().st_size > 5000
    results = json.loads((run / "results.json").read_text())
    assert results["curves"]["routers"]["oracle"]["gap_closed"] == pytest.approx(1.0)
    lo, hi = results["curves"]["routers"]["classifier"]["ci95"]  # bootstrap over windows (tiny models: any width)
    assert lo <= hi and results["curves_unseen"] and all("ci95" in v for v in results["curves_unseen"].values())
    areas = {name: r["area"] for name, r in results["curves"]["routers"].items()}
    assert areas["nll_oracle"] == pytest.approx(min(areas.values())) and "NLL over M_L**" in report
    assert {r["target"] for r in results["control"]} == {0.5, 0.7, 0.9}
    _check_generation_and_open_horizon(results, report, other_chat)


def _check_generation_and_open_horizon(results: dict, report: str, chat_domain: str) -> None:
    g = results["generation"]
    assert g["prompts"] == 2 and set(g["matched"]["routers"]) == {"oracle", "classifier", "entropy", "random"}
    for r in g["runs"]:  # every pooled figure is its per-prompt counts pooled
        p = r["per_prompt"]
        assert r["backoff_rate"] == pytest.approx(sum(p["small"]) / sum(p["tokens"]))
        assert r["large_nll"] == pytest.approx(sum(p["nll"]) / sum(p["tokens"]))
    assert [r for r in g["runs"] if r["label"] == "classifier@0.3"]  # the rate grid, not just the targets
    oh = results["open_horizon"]
    assert {r["mode"] for r in oh} == {"controller", "fixed", "random"}
    assert {r["domain"] for r in oh} == {chat_domain}  # only the unseen dir of chat records
    for ctrl in (r for r in oh if r["mode"] == "controller"):
        rand = next(
            r for r in oh if r["mode"] == "random" and (r["domain"], r["target"]) == (ctrl["domain"], ctrl["target"])
        )
        fixed = next(
            r for r in oh if r["mode"] == "fixed" and (r["domain"], r["target"]) == (ctrl["domain"], ctrl["target"])
        )
        cost = ctrl["quality_cost"]
        assert cost["vs_random"] == pytest.approx(ctrl["large_nll"] - rand["large_nll"])
        assert cost["vs_fixed"] == pytest.approx(ctrl["large_nll"] - fixed["large_nll"])
        assert max(ctrl["tokens"]) <= 8
    assert "Open-horizon control" in report and "matched" in report


def test_user_errors_exit_2(tmp_path, capsys):
    assert main(["router-train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "h")]) == 2
    assert "no router data" in capsys.readouterr().err
    assert main(["router-data", "--small", "x", "--out", str(tmp_path / "d"), "--corpus", "stdlib:nope"]) == 2
