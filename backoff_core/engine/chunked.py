"""Chunked prefill: a long prompt, and a lagging model's long catch-up, are fed over several
steps, at most `chunk` positions per model per step, between the live requests' decode
steps, so those keep committing a token every step while it loads.

Each request has one feed plan (`Live.plan`): per model (level), the positions its cache must
hold before the request steps again (its target), which `Live.fed[level]` catches up to, as
vLLM's scheduler brings a request's computed tokens up to its token count. A request whose
plan is open (a level short of its target) does not step: it commits nothing until the plan
is fed, and joins the step in the step its last chunk is fed. Stage 0 of every step (`feed`)
feeds the open plans, oldest request first, up to `chunk` positions per model shared by all
of them, in one batched last-only forward per model. A target comes from one of two places:
- admission (engine.submit_many, `plan_prompt`): a prompt whose head (all but its last
  token, which the first step reads) is longer than a chunk is the target of M_S and of
  every level opened at admission (eager prefill, oracles);
- a catch-up whose pending tokens pass a chunk (M_L's first catch-up reads the whole
  prompt), at a level forced in stage 1 or routed in stage 5 (`plans_catch_up`): the tokens
  before those it reads itself are that level's target. A routed step was taken by M_S
  already: it is undone (its cache cropped back, `undo_small`: the step "stalls") and taken
  again once the plan is fed. M_S's logits, the router's coin and every draw are pure
  functions of (seed, position), so it decides the same and the catch-up reads the last
  pending tokens only.
Outputs do not change: a cache fed in chunks holds the KV of one forward over the same
positions (within float tolerance), and no draw depends on when a position was fed.
Logits the step loop reads at pending positions (verification, the KL record: every
position after the prompt) stay in the catch-up; only positions before them are planned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from backoff_core.engine.backends import Backend
from backoff_core.engine.isolation import each, fail, reopen
from backoff_core.engine.logprobs import TokenTexts
from backoff_core.engine.prompt import adopt_prefix, prefills_large, score_window, start_scoring
from backoff_core.engine.propose import Decided
from backoff_core.engine.state import Live
from backoff_core.errors import KVCapacityError, LargeUnavailable
from backoff_core.types import FinishReason


def in_chunks(r: Live, chunk: int) -> bool:
    """Whether r's prompt is planned (fed over several steps) at admission: its head passes a
    chunk (a scored prompt is scored in chunks instead: scores_in_chunks)."""
    s = r.request.sampling
    return bool(chunk) and s.prompt_logprobs is None and s.max_tokens > 0 and r.prompt_len - 1 > chunk


def scores_in_chunks(r: Live, chunk: int) -> bool:
    """Whether r's prompt is scored over several steps (a window of rows per step, stage 0's
    `score`): it asks for prompt logprobs and its head passes a chunk."""
    return bool(chunk) and r.request.sampling.prompt_logprobs is not None and r.prompt_len - 1 > chunk


def plan_prompt(models: Sequence[Backend], r: Live) -> None:
    """At admission: r's prompt head is the target of the sessions prompt.prefill would open
    (M_S; eager levels, oracles), opened now; the steps feed them."""
    for level, model in enumerate(models):
        if level == 0 or prefills_large(r):
            plan(model, level, r, r.prompt_len - 1)
    _check_fits(models, r)


def _check_fits(models: Sequence[Backend], r: Live) -> None:
    # the whole prompt is refused now, as prefill would (the first chunk alone may fit)
    fits = getattr(models[0], "kv_fits", None)
    if fits is not None and not fits([(r.request_id, r.prompt_len)]):
        raise KVCapacityError(f"{models[0].name}: no KV room for a prompt of {r.prompt_len} tokens")


def open_scoring(models: Sequence[Backend], r: Live, texts: TokenTexts, decode: Callable) -> None:
    """At admission: r's prompt is scored in chunks; its sessions open (prompt.start_scoring)."""
    start_scoring(models, r, texts, decode)
    _check_fits(models, r)


def score(models: Sequence[Backend], group: list[Live], chunk: int, texts: TokenTexts, decode: Callable) -> None:
    """Stage 0's prompt scoring: the next `chunk` rows of the prompts being scored, oldest
    first, in one batched forward per model (prompt.score_window: M_S's logits over them, the
    router's levels, each level's scored rows; an oracle's M_L logits in pieces). A prompt
    whose last row is scored steps from the next step on (max_tokens 0: it is finished). A
    forward that fails ends the requests being scored (a larger model that cannot answer
    too: their rows have no score without it)."""
    try:
        score_window(models, group, texts, decode, rows=chunk)
    except Exception as exc:  # noqa: BLE001 - these requests end, with the error; the others go on
        for r in group:
            fail(r, exc, models)
        return
    now = time.perf_counter()
    for r in group:
        if r.scoring is None:
            r.stats.prefill_s = now - r.stats.started  # admission to its prompt scored
            if r.request.sampling.max_tokens == 0:  # nothing to generate
                r.finished = FinishReason.LENGTH


def plan(model: Backend, level: int, r: Live, target: int) -> None:
    """r's `level` cache must hold `target` positions before r steps again: r's plan gets that
    target where the cache is short of it (the plan opens: r.plan non-empty)."""
    if level not in r.opened:  # a fresh session
        model.open(r.request_id)
        r.opened.add(level)
        r.fed[level] = 0
        r.last_logits.pop(level, None)
        # PREFIX CACHE: a fresh session loads its longest cached prompt prefix (never all of
        # the ids passed, so at most `target` positions); only the rest is fed in chunks. now:
        # a remote model's replica looks it up before the first chunk, not within it
        r.fed[level] = adopt_prefix(model, r, r.tokens[: target + 1], now=True)
        if level == 0:
            r.stats.cached_prompt = r.fed[0]
    if r.fed[level] < target:
        if not r.plan:
            r.plan = [0] * r.num_levels  # 0: nothing to feed there
        r.plan[level] = target


def catch_up_target(r: Live, level: int, chunk: int, collect_kl: bool) -> int | None:
    """The positions r's `level` cache must hold before a catch-up there (None: nothing to
    plan, the catch-up reads at most one chunk or nothing can be fed early)."""
    if not chunk or len(r.tokens) - r.fed[level] <= chunk:
        return None
    reads_rows = r.verifies or (collect_kl and level == r.num_levels - 1)
    # the catch-up reads >= 1 token (the newest: its logits draw the step's token), and
    # every generated position whose logits it verifies or records
    target = min(len(r.tokens), r.prompt_len if reads_rows else len(r.tokens)) - 1
    return target if target > r.fed[level] else None


def plans_catch_up(models: Sequence[Backend], r: Live, level: int, chunk: int, collect_kl: bool) -> bool:
    """Whether r's catch-up at `level` (r stepping: no plan open) reads more than a chunk and
    so opens r's plan: r waits for it before this catch-up (a request whose session cannot be
    opened ends alone)."""
    target = catch_up_target(r, level, chunk, collect_kl)
    if target is None:
        return False
    each([r], models, lambda r: plan(models[level], level, r, target))
    return bool(r.plan) or r.failure is not None  # no plan: its prefix cache held it all


def plan_long_catch_ups(
    models: Sequence[Backend], live: list[Live], step: Decided, chunk: int, collect_kl: bool
) -> list[Live]:
    """Stage 5's start: the step's catch-ups that would read more than a chunk open their
    requests' plans: M_S's step undone (to step.fed), taken again once the plan is fed.
    Returns live without those (and those that ended: a session not opened)."""
    if not chunk or not any(level > 0 for level in step.levels.values()):
        return live
    levels = step.levels
    planned = [
        r
        for r in step.stepping
        if levels.get(r.request_id, 0) > 0
        and r.request_id not in step.outcomes
        and not (r.degraded or r.done)
        and plans_catch_up(models, r, levels[r.request_id], chunk, collect_kl)
    ]
    if not planned:
        return live
    routed_ids = {r.request_id for r in step.routed}
    for r in planned:
        each([r], models, lambda r: undo_small(models, r, step.fed[r.request_id], r.request_id in routed_ids))
    return [r for r in live if not (r.plan or r.done)]


def undo_small(models: Sequence[Backend], r: Live, fed: int, routed: bool) -> None:
    """Forget M_S's step of r (it is taken again once r's plan is fed): its cache back to
    `fed` positions, the step's timings dropped."""
    models[0].crop(r.request_id, fed)
    r.fed[0] = fed
    r.stats.small_times.pop()
    if routed and r.stats.router_times:
        r.stats.router_times.pop()


def feed(models: Sequence[Backend], group: list[Live], chunk: int, give_up: Callable[[int, Live, str], None]) -> None:
    """Stage 0: per model, up to `chunk` positions toward the targets of `group`'s plans
    (oldest first) in one batched last-only forward; a plan whose every target is reached
    closes. A request whose forward fails alone ends (or, at a larger model that cannot
    answer, goes on with M_S only: `give_up`)."""
    prompts = [r for r in group if r.fed[0] < r.plan[0]]  # M_S's prompt head still loading
    for level in range(len(models)):
        counts: dict[str, int] = {}  # request id -> positions fed this step
        budget = chunk
        for r in group:
            short = r.plan[level] - r.fed[level] if r.plan else 0
            if short > 0 and budget > 0 and not r.done:
                counts[r.request_id] = min(short, budget)
                budget -= counts[r.request_id]
        items = [r for r in group if r.request_id in counts]
        if items:
            _feed_level(models, level, items, counts, give_up)
    now = time.perf_counter()
    for r in prompts:
        if r.plan and r.fed[0] >= r.plan[0]:
            r.stats.prefill_s = now - r.stats.started  # admission to M_S's prompt fed, decode steps between included
    for r in group:
        if r.plan and all(fed >= target for fed, target in zip(r.fed, r.plan)):
            r.plan = []


def _feed_level(
    models: Sequence[Backend],
    level: int,
    group: list[Live],
    counts: dict[str, int],
    give_up: Callable[[int, Live, str], None],
) -> None:
    model = models[level]

    def ids(r: Live) -> list[int]:
        return r.tokens[r.fed[level] : r.fed[level] + counts[r.request_id]]

    def alone(r: Live) -> None:
        """After a failed shared forward: a fresh session fed from the start (the failed
        call may have half-written it); the rest of its target follows in later steps."""
        reopen(model, level, r)
        try:
            model.extend([(r.request_id, r.tokens[: counts[r.request_id]])], last_only=True)
        except LargeUnavailable as exc:
            if level == 0:
                raise
            give_up(level, r, str(exc))
            return
        r.fed[level] = counts[r.request_id]

    try:
        model.extend([(r.request_id, ids(r)) for r in group], last_only=True)
    except Exception as exc:  # noqa: BLE001 - a larger model gave up, or each request alone finds the culprit
        if isinstance(exc, LargeUnavailable) and level > 0:  # the sessions without a reply: M_S only
            for r in group:
                if r.request_id in exc.extensions:
                    r.fed[level] += counts[r.request_id]
                else:
                    give_up(level, r, str(exc))
        else:  # a lost (evicted) session is rebuilt; a request that fails alone ends
            each(group, models, alone)
        _drop_larger(group)
        return
    for r in group:
        r.fed[level] += counts[r.request_id]


def _drop_larger(group: list[Live]) -> None:
    """A request that lost its larger models has nothing left to feed there (one that ended,
    nothing at all)."""
    for r in group:
        if r.failure is not None:
            r.plan = []
        elif r.degraded and r.plan:
            r.plan[1:] = [0] * (len(r.plan) - 1)
