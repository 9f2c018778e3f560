"""benchmarks/penalty_overhead.py end to end at a small size: its rows run penalized or
biased (the tokens differ from the plain row's) and its figures and plot are saved."""

from __future__ import annotations

import json
import sys

from benchmarks import penalty_overhead


def test_the_rows_run_penalized_and_the_figures_are_saved(tmp_path, monkeypatch):
    runs = {}
    run = penalty_overhead.run

    def recorded(engine, streams, prompt, tokens, penalties, seed):
        submit = engine.submit
        ids = []
        engine.submit = lambda request, *a: ids.append(submit(request, *a)) or ids[-1]
        finish = engine.finish
        engine.finish = lambda request_id: runs.setdefault(tuple(sorted(penalties)), []).append(
            finish(request_id).token_ids
        )
        try:
            return run(engine, streams, prompt, tokens, penalties, seed)
        finally:
            engine.submit, engine.finish = submit, finish

    monkeypatch.setattr(penalty_overhead, "run", recorded)
    argv = ["penalty_overhead.py", "--streams", "3", "--prompt", "6", "--tokens", "24", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    penalty_overhead.main()
    report = json.loads((tmp_path / "penalty_overhead.json").read_text())
    assert list(report["rows"]) == list(penalty_overhead.ROWS)
    for row in report["rows"].values():
        assert len(row["quarters_ms"]) == 4 and all(ms > 0 for ms in row["quarters_ms"])
    assert report["rows"]["plain"]["last_quarter_over_plain"] == 1.0
    assert (tmp_path / "penalty_overhead.png").stat().st_size > 0
    plain = runs[()]
    assert report["rows"]["logit_bias, 300 ids"]["logit_bias"] == "300 ids, -1 each"
    for key in (("frequency_penalty", "presence_penalty"), ("repetition_penalty",), ("logit_bias",)):
        assert runs[key] != plain  # the penalties changed what was drawn
