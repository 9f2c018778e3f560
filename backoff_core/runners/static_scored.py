"""A StaticRunner's extend with scored rows (prompt scoring, scoring.py): one eager forward,
whose LM head with last_only runs on the scored columns and the last only."""

from __future__ import annotations

import time

from backoff_core.runners.extension import Extension
from backoff_core.runners.scoring import Scoring, score_rows
from backoff_core.runners.static_slots import SlotSession


class ScoredExtends:
    """StaticRunner's scored extends (the methods used here are StaticRunner's)."""

    def _extend_scored(
        self,
        sessions: list[SlotSession],
        new_ids: list[list[int]],
        layer: int | None,
        last_only: bool,
        scoring: list[Scoring | None],
    ) -> list[Extension]:
        """One eager forward for an extend with scored rows (prompt scoring, scoring.py)."""
        plan = self._plan(sessions, new_ids, layer, False)
        # scored rows of a last_only extend: the LM head on those columns (and the last) only
        columns = _columns(new_ids, scoring) if last_only else None
        logits, hidden = self._run(plan, columns)  # [B, K or C, V], [B, K, d] | None
        self.forward_passes += 1
        now = time.monotonic()
        results = []
        for i, (s, ids, row, sc) in enumerate(zip(sessions, new_ids, plan.rows.tolist(), scoring)):
            k = len(ids)
            s.length += k
            s.last_used = now
            h = hidden[row, :k] if hidden is not None else None
            where = {c: n for n, c in enumerate(columns[i])} if columns is not None else {j: j for j in range(k)}
            if plan.key.last_only:
                out = logits[row, :1]
            else:
                out = logits[row, where[k - 1] : where[k - 1] + 1] if last_only else logits[row, :k]
            scored = None
            if sc is not None:
                scored = score_rows(logits[row, [where[j] for j in sc.rows]], sc.targets, sc.top_n, sc.against)
            results.append(Extension(out, h, scored))
        return results


def _columns(new_ids: list[list[int]], scoring: list[Scoring | None]) -> list[list[int]]:
    """Per item: its scored rows and its last new id, ascending (the columns a forward keeps)."""
    return [sorted({len(ids) - 1, *(sc.rows if sc is not None else ())}) for ids, sc in zip(new_ids, scoring)]
