"""benchmarks/lm_eval_equivalence.compare on hand-written lm-eval sample files: equal runs
compare equal; a changed score, loglikelihood, greedy flag or generation is counted."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("lm_eval_equivalence", ROOT / "benchmarks" / "lm_eval_equivalence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(out: Path, task: str, samples: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"samples_{task}_2026.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def _mc(i, acc, ll, greedy=False):
    return {"doc_id": i, "acc": acc, "resps": [[[str(ll), greedy]], [[str(ll - 1.0), False]]]}


def _qa(i, em, text):
    return {"doc_id": i, "exact_match": em, "filtered_resps": [text]}


def test_equal_runs_and_each_kind_of_difference(tmp_path):
    m = _module()
    _write(tmp_path / "hf", "mc", [_mc(0, 1.0, -1.5, True), _mc(1, 0.0, -3.0)])
    _write(tmp_path / "hf", "qa", [_qa(0, 1.0, "blue"), _qa(1, 0.0, "red")])
    _write(tmp_path / "same", "mc", [_mc(0, 1.0, -1.50001, True), _mc(1, 0.0, -3.0)])
    _write(tmp_path / "same", "qa", [_qa(0, 1.0, "blue"), _qa(1, 0.0, "red")])
    same = m.compare(tmp_path / "hf", tmp_path / "same", tasks=("mc", "qa"))
    assert same["mc"]["same_score"] == 2 and same["mc"]["same_greedy_flag"] == 4
    assert same["mc"]["max_abs_diff"] == pytest.approx(1e-5) and same["qa"]["same_generation"] == 2
    _write(tmp_path / "other", "mc", [_mc(0, 0.0, -1.2), _mc(1, 0.0, -3.0)])
    _write(tmp_path / "other", "qa", [_qa(0, 1.0, "Blue"), _qa(1, 0.0, "red")])
    other = m.compare(tmp_path / "hf", tmp_path / "other", tasks=("mc", "qa"))
    assert other["mc"]["same_score"] == 1 and other["mc"]["same_greedy_flag"] == 3
    assert other["mc"]["max_abs_diff"] == pytest.approx(0.3) and other["qa"]["same_generation"] == 1
    _write(tmp_path / "short", "mc", [_mc(0, 1.0, -1.5, True)])
    with pytest.raises(RuntimeError, match="different items"):
        m.compare(tmp_path / "hf", tmp_path / "short", tasks=("mc",))
