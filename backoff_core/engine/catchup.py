"""Catch-up: one forward of a lagging model over all pending tokens of many requests, and
the optional verification of those tokens with the logits it yields for free (DESIGN §2).

A model that cannot answer in time (LargeUnavailable: too slow, no replica) costs the
requests without a reply their larger models for good: their sessions are closed (their
state is unknown: the call may still land) and they are marked `degraded`, so the step
loop takes M_S's token now and routes them nowhere else; or, with on_large_failure =
"fail", they end with the error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from backoff_core.engine.backends import Backend
from backoff_core.engine.host import to_host
from backoff_core.engine.isolation import batched, each, fail, reopen
from backoff_core.engine.penalties import penalties_at
from backoff_core.engine.prompt import adopt_prefix
from backoff_core.engine.state import Live
from backoff_core.errors import KVCapacityError, LargeUnavailable, SessionLost
from backoff_core.runners.extension import Extension, last_rows
from backoff_core.runners.sessions import SessionError
from backoff_core.sampling import Stream, distributions, draw, kl_divergence, residual, sample_rows, uniform
from backoff_core.types import CatchUp, Verification


@dataclass(frozen=True)
class Outcome:
    """What a catch-up at `level` decided for one request's step."""

    level: int
    logits: torch.Tensor  # [V] raw logits the step's token was drawn from
    token: int
    rolled_back: int  # committed tokens verification discarded (0: none)


@dataclass
class _Verdict:
    """What one request's catch-up decided, before it is applied."""

    token: int  # drawn from the newest logits: the step's token if every pending token stands
    kl: list[float] = field(default_factory=list)  # KL(M_L || M_S) at the positions recorded
    rejected: tuple[int, torch.Tensor, int] | None = None  # (position, p_level [V], replacement)


class CatchUpper:
    def __init__(self, models: Sequence[Backend], collect_kl: bool) -> None:
        self.models = list(models)
        self.collect_kl = collect_kl

    def run(self, level: int, group: list[Live]) -> dict[str, Outcome]:
        """Outcomes of the requests whose catch-up worked (a degraded request has none)."""
        if not group:
            return {}
        start = time.perf_counter()
        try:
            exts = self._extend(level, group)
        except LargeUnavailable as exc:
            for r in group:
                if r.request_id not in exc.extensions:
                    self.give_up(level, r, str(exc))
            group = [r for r in group if r.request_id in exc.extensions]
            exts = [exc.extensions[r.request_id] for r in group]
        except KVCapacityError as exc:
            if exc.extensions is None:  # the whole call was refused: find which sessions fit alone
                replies = self._one_by_one(level, group, exc)
            else:  # a remote model refused the new sessions it had no KV room for: those requests end
                replies = exc.extensions  # with a retriable error, the others carry on
                for r in group:
                    if r.request_id not in replies:
                        fail(r, exc, self.models)
            group = [r for r in group if r.request_id in replies]
            exts = [replies[r.request_id] for r in group]
        except Exception as exc:  # noqa: BLE001 - not an unavailable model: find whose catch-up it was
            replies = self._one_by_one(level, group, exc)
            group = [r for r in group if r.request_id in replies]
            exts = [replies[r.request_id] for r in group]
        seconds = time.perf_counter() - start
        rows = {}  # sid -> (r, positions fed before this forward, its extension)
        lengths = {}  # sid -> pending positions this forward read
        for r, ext in zip(group, exts):
            before = r.fed[level]  # after _extend: a re-prefill starts at 0
            rows[r.request_id] = (r, before, ext)
            lengths[r.request_id] = len(r.tokens) - before
            r.fed[level] = len(r.tokens)
        # every request's verification and the step's token: one batched pass, one host copy;
        # if it raises, each request alone finds the culprit (isolation.py)
        verdicts = batched(
            group,
            self.models,
            lambda g: self._judge(level, [rows[r.request_id] for r in g]),
            lambda r: self._judge(level, [rows[r.request_id]])[0],
        )
        outcomes = each(
            [r for r in group if r.request_id in verdicts],
            self.models,
            lambda r: self._apply(level, r, rows[r.request_id][2], verdicts[r.request_id]),
        )
        for request_id, outcome in outcomes.items():
            r, before, _ = rows[request_id]
            prompt = max(0, r.prompt_len - before)
            r.stats.catch_ups.append(
                CatchUp(level, lengths[request_id], seconds, outcome.rolled_back, len(group), prompt)
            )
        return outcomes

    def for_oracles(self, routed: list[Live]) -> tuple[list[Live], dict[str, Outcome]]:
        """Stage 3: the largest model catches up first for the routed requests whose router
        reads its logits (KL(M_L||M_S)), a batch per router. Returns (routed without those
        whose catch-up failed: degraded, they stay small; the outcomes)."""
        if not any(r.router.needs_large_logits for r in routed):
            return routed, {}
        groups: dict[object, list[Live]] = {}
        for r in routed:
            if r.router.needs_large_logits:
                groups.setdefault(r.router, []).append(r)
        outcomes: dict[str, Outcome] = {}
        for group in groups.values():
            outcomes.update(self.run(len(self.models) - 1, group))
        return [r for r in routed if not r.router.needs_large_logits or r.request_id in outcomes], outcomes

    def _judge(self, level: int, rows: list[tuple[Live, int, Extension]]) -> list[_Verdict]:
        """rows: (request, positions fed before this forward, its extension) -> what each
        request's step is: the first pending token verification rejects (and its
        replacement), else the token drawn from its newest logits. Every test, replacement
        and draw of the batch is computed on the device and read in one copy; the decisions
        are then taken on the host, in the order the positions were committed. Changes nothing."""
        checks = [c for r, b, ext in rows if r.verifies for c in self._checks(level, r, b, ext)]
        kls = [
            (r, ext.logits[j - b - 1], r.small_logits[j])
            for r, b, ext in (rows if self.collect_kl else ())
            for j in self._kl_at(level, r, b)
        ]
        logits = last_rows([ext for _, _, ext in rows])[0]  # [B, V]
        at = [(r, len(r.tokens)) for r, _, _ in rows]
        token = draw(
            logits,
            [r.sampling_at(p) for r, p in at],
            [r.seed for r, _, _ in rows],
            [p for _, p in at],
            penalties=penalties_at(at, logits),
        )  # [B]
        recorded = kl_divergence(torch.stack([c[1] for c in kls]), torch.stack([c[2] for c in kls])) if kls else None
        read = to_host(token, *([recorded] if kls else []), *self._tests(checks))
        verdicts = {r.request_id: _Verdict(t) for (r, _, _), t in zip(rows, read[0])}
        for (r, _, _), value in zip(kls, read[1] if kls else []):
            verdicts[r.request_id].kl.append(value)
        kl_test, p_x, q_x, replacement = read[-4:] if checks else ([], [], [], [])
        for i, (r, j, p_level, _) in enumerate(checks):
            verdict = verdicts[r.request_id]
            if verdict.rejected is not None:
                continue  # a later position of a request that already rolls back
            routing = r.request.routing
            if routing.verification == Verification.KL:
                accept = not kl_test[i] > routing.tolerance
            else:  # exact rejection sampling: accept x with probability min(1, q(x) / p(x))
                accept = uniform(r.seed, j, Stream.ACCEPT) * p_x[i] < q_x[i]
            if not accept:
                verdict.rejected = (j, p_level, replacement[i])
        return [verdicts[r.request_id] for r, _, _ in rows]

    def _apply(self, level: int, r: Live, ext: Extension, verdict: _Verdict) -> Outcome:
        r.stats.kl_at_catch_up.extend(verdict.kl)
        if verdict.rejected is not None:
            return self._roll_back(level, r, *verdict.rejected)
        r.last_logits[level] = last = ext.last
        return Outcome(level, last, verdict.token, 0)

    def _kl_at(self, level: int, r: Live, before: int) -> list[int]:
        """Positions whose KL(M_L || M_S) this catch-up records (collect_kl, largest model)."""
        if not (self.collect_kl and level == r.num_levels - 1):
            return []
        first = max(before, r.prompt_len)
        return [j for j in range(max(first, before + 1), len(r.tokens)) if j in r.small_logits]

    @staticmethod
    def _checks(level: int, r: Live, before: int, ext: Extension) -> list[tuple]:
        """(r, position j, p_level [V], p_source [V]) of every pending token of r that
        verification tests, in order. ext.logits [k, V]: row i predicts position before + i + 1
        (read only if something is tested)."""
        if not r.verifies:
            return []
        out, preds = [], ext.logits
        for j in range(max(before, r.prompt_len), len(r.tokens)):
            if r.sources[j - r.prompt_len] >= level:
                continue
            p_level = preds[j - before - 1] if j > before else r.last_logits.get(level)
            if p_level is not None and j in r.source_logits:
                out.append((r, j, p_level, r.source_logits[j]))
        return out

    @staticmethod
    def _tests(checks: list[tuple]) -> tuple[torch.Tensor, ...]:
        """For every check (r, j, p_level, p_source), on the device, each [R]: KL(p_level ||
        p_source), p(x) and q(x) of the committed token x under the source's and the level's
        distributions, and the token that replaces x if it is rejected (drawn from q, or from
        the residual for exact rejection sampling). () without checks."""
        if not checks:
            return ()
        level_logits = torch.stack([c[2] for c in checks])  # [R, V]
        source_logits = torch.stack([c[3] for c in checks])
        params = [c[0].sampling_at(c[1]) for c in checks]
        penalties = penalties_at([(c[0], c[1]) for c in checks], level_logits)
        q, p = (
            distributions(level_logits, params, None, penalties),
            distributions(source_logits, params, None, penalties),
        )
        x = torch.tensor([c[0].tokens[c[1]] for c in checks]).to(q.device, non_blocking=True)[:, None]  # [R, 1]
        exact = [c[0].request.routing.verification != Verification.KL for c in checks]
        if all(exact):
            kl, target = torch.zeros(len(checks), device=q.device), residual(q, p)
        else:
            kl = kl_divergence(level_logits, source_logits)
            target = q if not any(exact) else torch.where(torch.tensor(exact).to(q.device)[:, None], residual(q, p), q)
        seeds, positions = [c[0].seed for c in checks], [c[1] for c in checks]
        return kl, p.gather(-1, x)[:, 0], q.gather(-1, x)[:, 0], sample_rows(target, seeds, positions, Stream.REPLACE)

    def _one_by_one(self, level: int, group: list[Live], exc: Exception) -> dict[str, Extension]:
        """After a shared catch-up raised: each request alone, from a fresh session (the
        failed call may have half-written caches), so only the culprit fails."""
        if len(group) == 1:
            fail(group[0], exc, self.models)
            return {}
        replies = {}
        for r in group:
            try:
                reopen(self.models[level], level, r)
                replies[r.request_id] = self._extend(level, [r])[0]
            except LargeUnavailable as unavailable:
                self.give_up(level, r, str(unavailable))
            except Exception as err:  # noqa: BLE001 - the culprit
                fail(r, err, self.models)
        return replies

    def _extend(self, level: int, group: list[Live]) -> list[Extension]:
        model = self.models[level]
        for r in group:
            if level not in r.opened:  # lazy: the first call at this level prefills the prompt
                model.open(r.request_id)
                r.opened.add(level)
                r.fed[level] = adopt_prefix(model, r, r.tokens)  # PREFIX CACHE: from its cached prompt prefix
        # verification and the KL record read every new position; sampling reads the last one
        last_only = not self.collect_kl and not any(r.verifies for r in group)
        try:
            return model.extend([(r.request_id, r.tokens[r.fed[level] :]) for r in group], last_only=last_only)
        except (SessionError, SessionLost):
            # the model lost sessions (replica crash, TTL): the tokens are all here, so
            # rebuild every session of the group from scratch and try once more
            for r in group:
                model.close(r.request_id)
                model.open(r.request_id)
                r.fed[level] = 0
                r.last_logits.pop(level, None)
            return model.extend([(r.request_id, list(r.tokens)) for r in group], last_only=last_only)

    def give_up(self, level: int, r: Live, reason: str) -> None:
        """The request goes on with M_S alone (or fails): no larger model is called again."""
        r.degraded = reason or f"{self.models[level].name} unavailable"
        if r.request.routing.on_large_failure == "fail":
            r.failure = LargeUnavailable(r.degraded)
        for m in sorted(r.opened - {0}):
            try:
                self.models[m].close(r.request_id)  # fire and forget for a remote model
            except Exception:  # noqa: BLE001 - an unreachable model has its own ways to free it
                pass
        r.opened &= {0}

    def _roll_back(self, level: int, r: Live, j: int, p_level: torch.Tensor, token: int) -> Outcome:
        dropped = r.truncate(j)
        r.stats.rollbacks += dropped
        for m, model in enumerate(self.models):
            if r.fed[m] > j:
                model.crop(r.request_id, j)
                r.fed[m] = j
                r.last_logits.pop(m, None)
        r.last_logits[level] = p_level  # it predicted position j, which the new token fills
        return Outcome(level, p_level, token, dropped)
