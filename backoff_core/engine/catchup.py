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
from dataclasses import dataclass
from typing import Sequence

import torch

from backoff_core.engine.backends import Backend, LargeUnavailable, SessionLost
from backoff_core.engine.isolation import batched, fail, reopen
from backoff_core.engine.state import Live
from backoff_core.runners.dynamic import Extension
from backoff_core.runners.sessions import SessionError
from backoff_core.runners.static_kv import KVCapacityError
from backoff_core.sampling import Stream, distribution, draw, kl_divergence, residual, sample, uniform
from backoff_core.types import CatchUp, Verification


@dataclass(frozen=True)
class Outcome:
    """What a catch-up at `level` decided for one request's step."""

    level: int
    logits: torch.Tensor  # [V] raw logits the step's token was drawn from
    token: int
    rolled_back: int  # committed tokens verification discarded (0: none)


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
                    self._give_up(level, r, str(exc))
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
        before = [r.fed[level] for r in group]  # after _extend: a re-prefill starts at 0
        outcomes, kept = {}, {}  # kept: sid -> logits [V] of the requests whose drafts all stand
        lengths = {}  # sid -> (pending positions this forward read, positions fed before it)
        for r, b, ext in zip(group, before, exts):
            lengths[r.request_id] = (len(r.tokens) - b, b)
            r.fed[level] = len(r.tokens)
            try:
                outcome = self._verify(level, r, b, ext)
            except Exception as exc:  # noqa: BLE001 - its verification: this request alone
                fail(r, exc, self.models)
                continue
            if outcome is None:
                kept[r.request_id] = ext.logits[-1]
            else:
                outcomes[r.request_id] = outcome
        # the step's token of every request that kept its drafts: one batched draw, one host copy
        waiting = [r for r in group if r.request_id in kept]
        tokens = batched(waiting, self.models, lambda g: self._draw(g, kept), lambda r: self._draw([r], kept)[0])
        outcomes.update(
            (request_id, Outcome(level, kept[request_id], token, 0)) for request_id, token in tokens.items()
        )
        for r in group:
            if r.request_id in outcomes:
                length, b = lengths[r.request_id]
                r.catch_ups.append(
                    CatchUp(
                        level, length, seconds, outcomes[r.request_id].rolled_back, len(group), max(0, r.prompt_len - b)
                    )
                )
        return outcomes

    @staticmethod
    def _draw(group: Sequence[Live], logits: dict[str, torch.Tensor]) -> list[int]:
        return draw(
            torch.stack([logits[r.request_id] for r in group]),
            [r.request.sampling for r in group],
            [r.seed for r in group],
            [len(r.tokens) for r in group],
        )

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
                self._give_up(level, r, str(unavailable))
            except Exception as err:  # noqa: BLE001 - the culprit
                fail(r, err, self.models)
        return replies

    def _extend(self, level: int, group: list[Live]) -> list[Extension]:
        model = self.models[level]
        for r in group:
            if level not in r.opened:  # lazy: the first call at this level prefills the prompt
                model.open(r.request_id)
                r.opened.add(level)
        # verification and the KL record read every new position; sampling reads the last one
        last_only = not self.collect_kl and all(r.request.routing.verification == Verification.NONE for r in group)
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

    def _give_up(self, level: int, r: Live, reason: str) -> None:
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

    def _verify(self, level: int, r: Live, before: int, ext: Extension) -> Outcome | None:
        """The outcome of a verification that rolled back; None when every pending token
        stands (the step's token is then drawn from preds[-1], batched, by run())."""
        preds = ext.logits  # [k, V]; preds[i] predicts position before + i + 1
        routing = r.request.routing
        first = max(before, r.prompt_len)
        if self.collect_kl and level == r.num_levels - 1:
            for j in range(max(first, before + 1), len(r.tokens)):
                if j in r.small_logits:
                    r.kl_at_catch_up.append(float(kl_divergence(preds[j - before - 1], r.small_logits[j])))
        if routing.verification != Verification.NONE:
            for j in range(first, len(r.tokens)):
                if r.sources[j - r.prompt_len] >= level:
                    continue
                p_level = preds[j - before - 1] if j > before else r.last_logits.get(level)
                if p_level is None or j not in r.source_logits:
                    continue
                replacement = self._check(r, j, p_level, r.source_logits[j])
                if replacement is not None:
                    return self._roll_back(level, r, j, p_level, replacement)
        r.last_logits[level] = preds[-1]
        return None

    def _check(self, r: Live, j: int, p_level: torch.Tensor, p_source: torch.Tensor) -> int | None:
        """None to accept the token at position j, else the token that replaces it."""
        routing, params = r.request.routing, r.request.sampling
        if routing.verification == Verification.KL:
            if float(kl_divergence(p_level, p_source)) > routing.tolerance:
                return sample(distribution(p_level, params), r.seed, j, Stream.REPLACE)
            return None
        # exact rejection sampling: accept x with probability min(1, q(x) / p(x))
        q, p = distribution(p_level, params), distribution(p_source, params)
        x = r.tokens[j]
        if uniform(r.seed, j, Stream.ACCEPT) * float(p[x]) < float(q[x]):
            return None
        return sample(residual(q, p), r.seed, j, Stream.REPLACE)

    def _roll_back(self, level: int, r: Live, j: int, p_level: torch.Tensor, token: int) -> Outcome:
        dropped = r.truncate(j)
        r.rollbacks += dropped
        for m, model in enumerate(self.models):
            if r.fed[m] > j:
                model.crop(r.request_id, j)
                r.fed[m] = j
                r.last_logits.pop(m, None)
        r.last_logits[level] = p_level  # it predicted position j, which the new token fills
        return Outcome(level, p_level, token, dropped)
