"""Step stage 6 (commit): append each request's token of the step, check its stop
conditions, and build the streamed events (stable text, logprobs), for the whole step at
once: one host copy for every logprob asked for, one batched decode for every text."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backoff_core.engine.backends import Backend
from backoff_core.engine.isolation import each
from backoff_core.engine.logprobs import TokenTexts, logprob_values, token_logprobs
from backoff_core.engine.state import Detokenizer, Live
from backoff_core.types import FinishReason, TokenEvent, Verification


@dataclass(frozen=True)
class CommitContext:
    """What committing reads of the engine (taken afresh each step)."""

    detok: Detokenizer
    token_texts: TokenTexts
    eos_ids: frozenset[int]
    collect_kl: bool


@dataclass(frozen=True)
class Commit:
    """One request's token of this step, from level `source`, after `retracted` rolled-back tokens."""

    r: Live
    token: int
    source: int
    logits: torch.Tensor  # [V] raw logits the token was drawn from
    small: tuple | None  # (M_S logits [V], hidden) of this step, if M_S ran
    retracted: int


def commit_many(commits: Sequence[Commit], ctx: CommitContext, models: Sequence[Backend]) -> dict[str, TokenEvent]:
    """commits: appended already (`append`) -> sid -> the streamed event of each; a request
    whose commit raises fails alone."""
    by_id = {c.r.request_id: c for c in commits}
    asking = [c for c in commits if c.r.request.sampling.logprobs is not None]
    try:  # one host copy for all of them; if it raises, each reads its own below
        values = logprob_values(
            [c.logits for c in asking], [c.token for c in asking], [c.r.request.sampling.logprobs for c in asking]
        )
        values = {c.r.request_id: v for c, v in zip(asking, values)}
    except Exception:  # noqa: BLE001 - the culprit fails alone in finish()
        values = {}
    try:  # every text decoded in one pass; if it raises, each decodes its own
        ctx.detok.prime([c.r for c in commits])
    except Exception:  # noqa: BLE001
        ctx.detok.forget()
    try:
        return each(
            [c.r for c in commits], models, lambda r: finish(by_id[r.request_id], ctx, values.get(r.request_id))
        )
    finally:
        ctx.detok.forget()


def append(c: Commit, ctx: CommitContext) -> None:
    """The bookkeeping of r's new token."""
    r = c.r
    position = len(r.tokens)
    r.tokens.append(c.token)
    r.sources.append(c.source)
    if r.num_levels > c.source + 1 and r.request.routing.verification != Verification.NONE and not r.degraded:
        r.source_logits[position] = c.logits
    if ctx.collect_kl and c.small is not None:
        r.small_logits[position] = c.small[0]
    r.prune()
    if r.first_token_s is None:
        r.first_token_s = time.perf_counter() - r.started


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
    return dataclasses.replace(event, logprobs=entry)


def check_stop(r: Live, token: int, ctx: CommitContext) -> None:
    """Set r.finished (or finish_after_verify while drafts await verification) at EOS, a stop
    string or max_tokens. Only a request with stop strings reads its text."""
    params = r.request.sampling
    reason = None
    if token in ctx.eos_ids and not params.ignore_eos:
        reason = FinishReason.STOP
    elif params.stop:
        text = ctx.detok.decoded(r)
        hits = [text.find(s) for s in params.stop if s in text]
        if hits:
            r.cut_at = min(hits)
            reason = FinishReason.STOP
    if reason is None and len(r.tokens) - r.prompt_len >= params.max_tokens:
        reason = FinishReason.LENGTH
    verified = r.request.routing.verification != Verification.NONE and not r.degraded
    if reason is not None and verified and r.drafts():
        r.finish_after_verify = reason  # never hand out tokens verification would reject
    else:
        r.finished = reason
