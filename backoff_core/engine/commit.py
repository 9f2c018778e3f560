"""Step stage 6 (commit): append each request's token of the step, check its stop
conditions, and build the streamed events (stable text, logprobs), for the whole step at
once: one host copy for every logprob asked for. Each loop here runs once per request and
step, so it is kept to plain Python on host data: no tensor is sliced unless read (Commit)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from backoff_core.engine.backends import Backend
from backoff_core.engine.catchup import Outcome
from backoff_core.engine.isolation import fail
from backoff_core.engine.logprobs import TokenTexts, logprob_values, token_logprobs
from backoff_core.engine.propose import Proposal, SmallOut
from backoff_core.engine.state import Detokenizer, Live
from backoff_core.types import FinishReason, TokenEvent


@dataclass(frozen=True)
class CommitContext:
    """What committing reads of the engine (taken afresh each step)."""

    detok: Detokenizer
    token_texts: TokenTexts
    eos_ids: frozenset[int]
    collect_kl: bool


class Commit(NamedTuple):
    """One request's token of this step, from level `source`, after `retracted` rolled-back
    tokens (a NamedTuple: immutable, and cheap to build once per request and step)."""

    r: Live
    token: int
    source: int
    retracted: int
    outcome: Outcome | None  # the catch-up that gave the token; None: M_S's draw
    small: SmallOut  # M_S's outputs of this step

    @property
    def logits(self) -> torch.Tensor:
        """[V] raw logits the token was drawn from (sliced only when read)."""
        return self.outcome.logits if self.outcome is not None else self.small.logits_of(self.r.request_id)

    def small_logits(self) -> torch.Tensor | None:
        """[V] M_S's logits of this step, if M_S ran for r."""
        return self.small.logits_of(self.r.request_id) if self.r.request_id in self.small else None


def settle_many(
    group: Sequence[Live],
    outcomes: dict[str, Outcome],
    small: SmallOut,
    proposal: Proposal,
    ctx: CommitContext,
    models: Sequence[Backend],
) -> list[Commit]:
    """`settle` for each request of the step that has not failed, in order; a request whose
    settle raises fails alone."""
    commits = []
    for r in group:  # isolation.each, inline: this loop runs once per request and step
        if r.failure is not None:
            continue
        try:
            c = settle(r, outcomes.get(r.request_id), small, proposal, ctx)
        except Exception as exc:  # noqa: BLE001 - ends this request, with its error
            fail(r, exc, models)
            continue
        if c is not None:
            commits.append(c)
    return commits


def settle(r: Live, outcome: Outcome | None, small: SmallOut, proposal: Proposal, ctx: CommitContext) -> Commit | None:
    """Append r's token of this step (None: nothing to commit; commit_many streams it)."""
    if outcome is None:
        if r.finish_after_verify:  # the verification failed: the drafts stand
            r.finished = r.finish_after_verify
            return None
        token = proposal.tokens.get(r.request_id)  # stays small
        if token is None:  # its draw failed: it ended alone (isolation.py)
            return None
        retracted = source = 0
    else:
        token, retracted, source = outcome.token, outcome.rolled_back, outcome.level
    if r.controller is not None and r.request_id in proposal.scores:
        r.thresholds = (r.controller.update(proposal.scores[r.request_id], source == 0),)
    if outcome is not None and source == r.num_levels - 1:
        r.schedule_drafts(rejected=retracted > 0)
    if r.finish_after_verify:
        if not retracted:
            r.finished = r.finish_after_verify  # all drafts held: the extra token is not wanted
            return None
        r.finish_after_verify = None
    r.cut_at = None
    c = Commit(r, token, source, retracted, outcome, small)
    append(c, ctx)
    return c


def commit_many(commits: Sequence[Commit], ctx: CommitContext, models: Sequence[Backend]) -> dict[str, TokenEvent]:
    """commits: appended already (`append`) -> sid -> the streamed event of each; a request
    whose commit raises fails alone."""
    values = {}
    asking = [c for c in commits if c.r.request.sampling.logprobs is not None]
    if asking:
        try:  # one host copy for all of them; if it raises, each reads its own below
            read = logprob_values(
                [c.logits for c in asking], [c.token for c in asking], [c.r.request.sampling.logprobs for c in asking]
            )
            values = {c.r.request_id: v for c, v in zip(asking, read)}
        except Exception:  # noqa: BLE001 - the culprit fails alone in finish()
            values = {}
    events = {}
    for c in commits:  # isolation.each, inline: this loop runs once per request and step
        try:
            events[c.r.request_id] = finish(c, ctx, values.get(c.r.request_id))
        except Exception as exc:  # noqa: BLE001 - ends this request, with its error
            fail(c.r, exc, models)
    ctx.detok.forget()
    return events


def append(c: Commit, ctx: CommitContext) -> None:
    """The bookkeeping of r's new token."""
    r = c.r
    position = len(r.tokens)
    r.tokens.append(c.token)
    r.sources.append(c.source)
    if r.verifies and r.num_levels > c.source + 1 and not r.degraded:
        r.source_logits[position] = c.logits
    if ctx.collect_kl and r.request_id in c.small:
        r.small_logits[position] = c.small_logits()
    if r.source_logits or r.small_logits:  # the common case (no verification, no KL record): nothing
        r.prune()
    if r.stats.first_token_s is None:
        r.stats.first_token_s = time.perf_counter() - r.stats.started


def finish(c: Commit, ctx: CommitContext, values) -> TokenEvent:
    """The stop check and the streamed event with its text and logprobs (values: what
    logprob_values read for it, None: read here)."""
    r = c.r
    check_stop(r, c.token, ctx)
    event = ctx.detok.event(r, c.source, c.retracted)
    if r.request.sampling.logprobs is None:
        return event
    # under the source level's raw distribution: `logits` are the ones the token was drawn
    # from (logprobs.py); a rollback's truncate() already dropped the retracted entries
    entry = token_logprobs(
        c.logits,
        c.token,
        r.request.sampling.logprobs,
        ctx.token_texts,
        text_offset=len(r.text) - len(event.text),
        values=values,
    )
    r.logprobs.append(entry)
    e = event  # dataclasses.replace, written out: it costs ~10x TokenEvent's own __init__
    return TokenEvent(e.token_id, e.source, e.text, e.index, e.retracted, e.retracted_text, entry)


def check_stop(r: Live, token: int, ctx: CommitContext) -> None:
    """Set r.finished (or finish_after_verify while drafts await verification) at EOS, a stop
    token id, a stop string or max_tokens. Only a request with stop strings reads its text."""
    params = r.request.sampling
    reason = None
    if len(r.tokens) - r.prompt_len < params.min_tokens:  # only max_tokens ends it yet (min <= max)
        if params.stop:  # a stop string must end past the text of the first min_tokens (as vLLM's)
            r.stop_from = len(ctx.detok.decoded(r, hold=True))
    elif (token in ctx.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
        reason = FinishReason.STOP
    elif params.stop:
        text = ctx.detok.decoded(r, hold=True)  # the event reads it again
        hits = [i for s in params.stop if (i := text.find(s, max(0, r.stop_from - len(s) + 1))) >= 0]
        if hits:
            r.cut_at = min(hits)
            reason = FinishReason.STOP
    if reason is None and len(r.tokens) - r.prompt_len >= params.max_tokens:
        reason = FinishReason.LENGTH
    if reason is None:
        return  # r goes on (a committing request is not finished)
    verified = r.verifies and not r.degraded
    if verified and r.drafts():
        r.finish_after_verify = reason  # never hand out tokens verification would reject
    else:
        r.finished = reason
