"""Bytes on the catch-up wire under the oracle routers, both ways (issue 56, item 2).

    python benchmarks/oracle_wire_bytes.py      # a second; no model: sizes do not depend on values

An oracle's score at a row is KL(M_L || M_S), which reads both full distributions, so one of
them crosses between SmallModel and LargeModel whichever side computes it. Per case, the
pickled CatchUpCall (SmallModel -> LargeModel) and CatchUpReply (back), as Ray ships them
(pickle protocol 5, numpy and torch payloads in one frame), at the default pair's vocabulary:
- prompt scoring (echo, `logprobs` n) of `--rows` rows, `max_logit_rows` rows a call:
  `logits_back` (M_L answered full logits [k, V], the step loop took the KL: the old wire) and
  `kl_at_large` (M_S's logits go in Scoring.against, M_L answers the KL, target and top-n a row
  and no logits row: the wire now);
- one generation step of one request: M_L's last row back ([1, V], the wire now: the step's
  draw, its logprobs and verification read it) and the alternative of M_S's row going out.
Saves benchmarks/results/oracle_wire_bytes.json.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backoff_core.runners.scoring import Scoring, score_rows  # noqa: E402
from deployments.serving.catchup_wire import CatchUpCall, CatchUpReply, ScoredRows  # noqa: E402
from deployments.serving.remote import LOGIT_ROWS_BYTES  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "oracle_wire_bytes.json"


def _size(obj) -> int:
    return len(pickle.dumps(obj, protocol=5))


def _calls(rows: int, piece: int) -> list[tuple[int, int]]:
    return [(a, min(rows, a + piece)) for a in range(0, rows, piece)]


def logits_back(rows: int, piece: int, vocab: int, top_n: int) -> dict:
    """The old wire: each call feeds a piece of ids, the reply is M_L's logits there."""
    sent = got = 0
    for a, b in _calls(rows, piece):
        call = CatchUpCall("req#1", a, tuple(range(a, b)), owner="small-1", last_only=False)
        sent += _size(call)
        got += _size(CatchUpReply(np.zeros((b - a, vocab), dtype=np.float32)))
    return {"calls": len(_calls(rows, piece)), "request_bytes": sent, "reply_bytes": got}


def kl_at_large(rows: int, piece: int, vocab: int, top_n: int) -> dict:
    """The wire now: each call carries M_S's logits of its rows, the reply their KL and scores."""
    sent = got = 0
    for a, b in _calls(rows, piece):
        small, large = torch.randn(b - a, vocab), torch.randn(b - a, vocab)
        scoring = Scoring(tuple(range(b - a)), tuple(range(b - a)), top_n, small)
        ids = tuple(range(a, b))
        call = CatchUpCall("req#1", a, ids, owner="small-1", last_only=True, scoring=scoring, scored_only=True)
        sent += _size(call)
        scored = ScoredRows.of(score_rows(large, scoring.targets, top_n, small))
        got += _size(CatchUpReply(np.zeros((0, vocab), dtype=np.float32), scored=scored))
    return {"calls": len(_calls(rows, piece)), "request_bytes": sent, "reply_bytes": got}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152, help="the default pair's vocabulary")
    ap.add_argument("--rows", type=int, default=199, help="scored prompt rows (a 200-token prompt)")
    ap.add_argument("--top-n", type=int, default=5, help="echo's logprobs")
    args = ap.parse_args()
    piece = max(1, LOGIT_ROWS_BYTES // (4 * args.vocab))  # RemoteLarge.max_logit_rows
    step_back = _size(CatchUpReply(np.zeros((1, args.vocab), dtype=np.float32)))
    step_out = _size(torch.randn(1, args.vocab))
    out = {
        "vocab": args.vocab,
        "rows": args.rows,
        "top_n": args.top_n,
        "max_logit_rows": piece,
        "prompt_scoring": {
            way: fn(args.rows, piece, args.vocab, args.top_n)
            for way, fn in (("logits_back", logits_back), ("kl_at_large", kl_at_large))
        },
        "generation_step": {"large_row_back_bytes": step_back, "small_row_out_bytes": step_out},
    }
    for v in out["prompt_scoring"].values():
        v["total_bytes"] = v["request_bytes"] + v["reply_bytes"]
        v["reply_bytes_per_row"] = round(v["reply_bytes"] / args.rows, 1)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
