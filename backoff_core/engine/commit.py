"""Step stage 6 (commit): append a request's token of the step, check its stop conditions,
and build the streamed event (stable text, logprobs)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from backoff_core.engine.logprobs import TokenTexts, token_logprobs
from backoff_core.engine.state import Detokenizer, Live
from backoff_core.types import FinishReason, TokenEvent, Verification


@dataclass(frozen=True)
class CommitContext:
    """What committing reads of the engine (taken afresh each step)."""

    detok: Detokenizer
    token_texts: TokenTexts
    eos_ids: frozenset[int]
    collect_kl: bool


def commit(r: Live, token: int, source: int, logits, small, retracted: int, ctx: CommitContext) -> TokenEvent:
    """Append r's token of this step (from level `source`, after `retracted` rolled-back tokens):
    bookkeeping, the stop check, the streamed event with its text and logprobs."""
    position = len(r.tokens)
    r.tokens.append(token)
    r.sources.append(source)
    if r.num_levels > source + 1 and r.request.routing.verification != Verification.NONE and not r.degraded:
        r.source_logits[position] = logits
    if ctx.collect_kl and small is not None:
        r.small_logits[position] = small[0]
    r.prune()
    if r.first_token_s is None:
        r.first_token_s = time.perf_counter() - r.started
    check_stop(r, token, ctx)
    event = ctx.detok.event(r, source, retracted)
    if r.request.sampling.logprobs is None:
        return event
    # under the source level's raw distribution: `logits` are the ones the token was drawn
    # from (logprobs.py); a rollback's truncate() already dropped the retracted entries
    entry = token_logprobs(
        logits, token, r.request.sampling.logprobs, ctx.token_texts, text_offset=len(r.text) - len(event.text)
    )
    r.logprobs.append(entry)
    return dataclasses.replace(event, logprobs=entry)


def check_stop(r: Live, token: int, ctx: CommitContext) -> None:
    """Set r.finished (or finish_after_verify while drafts await verification) at EOS, a stop
    string or max_tokens."""
    params = r.request.sampling
    reason = None
    if token in ctx.eos_ids and not params.ignore_eos:
        reason = FinishReason.STOP
    elif params.stop:
        text = ctx.detok.decode(r.generated)
        hits = [text.find(s) for s in params.stop if s in text]
        if hits:
            r.cut_at = min(hits)
            reason = FinishReason.STOP
    if reason is None and len(r.generated) >= params.max_tokens:
        reason = FinishReason.LENGTH
    verified = r.request.routing.verification != Verification.NONE and not r.degraded
    if reason is not None and verified and r.drafts():
        r.finish_after_verify = reason  # never hand out tokens verification would reject
    else:
        r.finished = reason
