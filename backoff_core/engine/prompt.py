"""Admission: the prompt prefill of many requests, batched, and prompt logprobs.

Every model's cache holds all but the last prompt token after admission where it is
opened (M_S always; a larger level when prefilled eagerly, for an oracle, or when it scores
prompt tokens), so every step reads >= 1 pending token. Requests are prefilled together,
in chunks of at most PREFILL_TOKENS padded positions (ragged lengths are the runner's
business), one forward per model and chunk.

Prompt logprobs (SamplingParams.prompt_logprobs) are the request's ROUTED, TEACHER-FORCED
distribution (DESIGN.md §7): prompt token i+1 is scored from the true prefix <= i by the
level the request's router picks at row i, from what it would see there in generation:
M_S's logits and hidden state after token i, the largest model's logits (oracles), the
request's seeded coin for position i+1 (`random`), the request's thresholds (with
target_backoff: the controller's threshold at admission; the controller does not move on
the prompt). The value is log_softmax (temperature 1, raw) of that level's logits at row i,
as for generated tokens (logprobs.py). So always-large gives M_L's log-softmax of the prompt
and always-small M_S's. Only what is needed is computed: M_S's logits at every row (every
router may read them), a larger level's log-probabilities at the rows routed to it alone,
as scored rows (runners/scoring.py: the target and top-n, never full logits on the wire).
Routers that read drafts (`draft`) or replay a script have no prompt decision: refused.
Verification never applies to the prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from backoff_core.engine.backends import Backend
from backoff_core.engine.host import to_host
from backoff_core.engine.logprobs import TokenTexts
from backoff_core.engine.state import Live, PromptScores
from backoff_core.routing.routers import StepContext
from backoff_core.runners.dynamic import Extension
from backoff_core.runners.scoring import Scored, Scoring, score_rows
from backoff_core.sampling import Stream, uniforms
from backoff_core.types import TokenLogprobs

PREFILL_TOKENS = 2048  # padded positions per prefill forward (full M_S logits: ~400 MB at V = 49152)


def prefill(models: Sequence[Backend], lives: list[Live], texts: TokenTexts, decode: Callable) -> None:
    """Open and prefill the sessions of newly admitted requests, and score the prompts of
    those that ask. Raises what a model raised, with every session it opened closed."""
    start = time.perf_counter()
    try:
        for chunk in _chunks(lives):
            _prefill_chunk(models, chunk, texts, decode)
    except Exception:
        for r in lives:
            for level in sorted(r.opened):
                try:
                    models[level].close(r.request_id)
                except Exception:  # noqa: BLE001 - a lost remote session is already gone
                    pass
            r.opened.clear()
        raise
    seconds = time.perf_counter() - start
    for r in lives:
        r.stats.prefill_s = seconds


def _chunks(lives: list[Live]) -> list[list[Live]]:
    """Requests in groups of at most PREFILL_TOKENS padded positions (a longer one alone),
    similar lengths together so little is padding."""
    chunks: list[list[Live]] = []
    for r in sorted(lives, key=lambda r: r.prompt_len):
        if chunks and (len(chunks[-1]) + 1) * r.prompt_len <= PREFILL_TOKENS:
            chunks[-1].append(r)
        else:
            chunks.append([r])
    return chunks


def _head(r: Live) -> list[int]:
    return list(r.request.prompt_ids[:-1])


def _open(model: Backend, level: int, r: Live) -> None:
    if level not in r.opened:
        model.open(r.request_id)
        r.opened.add(level)


def prefills_large(r: Live) -> bool:
    """Whether r's admission opens and prefills its larger models too, not M_S alone (an
    eager prefill, or an oracle router, which reads M_L's logits at every step)."""
    return r.request.routing.eager_prefill or r.router.needs_large_logits


def admission_runs_large(r: Live) -> bool:
    """Whether admitting r runs a larger model: its prefill, or prompt scoring."""
    return prefills_large(r) or r.request.sampling.prompt_logprobs is not None


def _prefill_chunk(models: Sequence[Backend], chunk: list[Live], texts: TokenTexts, decode: Callable) -> None:
    for r in chunk:
        for level, model in enumerate(models):
            if level == 0 or prefills_large(r):
                _open(model, level, r)
    scoring = [r for r in chunk if r.request.sampling.prompt_logprobs is not None]
    plain = [r for r in chunk if r.request.sampling.prompt_logprobs is None and r.prompt_len > 1]
    # PREFIX CACHE (runners/prefix_cache.py): each opened session starts from its longest cached
    # prompt prefix (r.fed); scored prompts skip it, they need every row's logits
    for r in plain:
        for level in sorted(r.opened):
            r.fed[level] = adopt_prefix(models[level], r, r.request.prompt_ids)
        r.stats.cached_prompt = r.fed[0]
    for level, model in enumerate(models):
        _extend(model, level, [r for r in plain if level in r.opened], last_only=True)
    if scoring:
        _score(models, scoring, texts, decode)


def _extend(
    model: Backend,
    level: int,
    group: list[Live],
    *,
    last_only: bool,
    hidden_layer: int | None = None,
    scoring: list[Scoring | None] | None = None,
) -> list[Extension]:
    """One forward over the prompt heads of `group` at `level` (sessions open)."""
    group = [r for r in group if r.fed[level] < r.prompt_len - 1]  # a whole head adopted: nothing to feed
    if not group:
        return []
    items = [(r.request_id, _head(r)[r.fed[level] :]) for r in group]
    if scoring is not None and any(sc is not None for sc in scoring):
        exts = model.extend(items, hidden_layer=hidden_layer, last_only=last_only, scoring=scoring)
    else:  # no scoring argument: any Backend takes this call
        exts = model.extend(items, hidden_layer=hidden_layer, last_only=last_only)
    for r in group:
        r.fed[level] = r.prompt_len - 1
    return exts


def _score(models: Sequence[Backend], group: list[Live], texts: TokenTexts, decode: Callable) -> None:
    """Prompt logprobs of `group`: M_S over every row, the router's level per row, each
    level's scored rows, then the entries (the first prompt token has none)."""
    top = len(models) - 1
    heads = [r for r in group if r.prompt_len > 1]
    layers = {r.router.hidden_layer for r in heads} - {None}
    if len(layers) > 1:
        raise ValueError("one batch cannot serve classifier heads over different layers")
    layer = next(iter(layers), None)
    # rows before a request's first scored one (prompt_logprobs_from - 1): a plain prefill
    # of M_S first, then M_S's logits over the scored rows alone
    ahead = [r for r in heads if _first_row(r) > 0]
    if ahead:
        models[0].extend([(r.request_id, _head(r)[: _first_row(r)]) for r in ahead], last_only=True)
    items = [(r.request_id, _head(r)[_first_row(r) :]) for r in heads]
    small = dict(zip([r.request_id for r in heads], models[0].extend(items, hidden_layer=layer, last_only=False)))
    for r in heads:
        r.fed[0] = r.prompt_len - 1
    oracles = [r for r in heads if r.router.needs_large_logits]
    large = dict(zip([r.request_id for r in oracles], _extend(models[top], top, oracles, last_only=False)))
    # levels[request id][i]: the level of prompt row _first_row(r) + i
    levels = {r.request_id: _levels(r, small[r.request_id], large.get(r.request_id)) for r in heads}
    # scored[request id][level] = (rows, Scored): the rows that level scores
    scored: dict[str, dict[int, tuple[list[int], Scored]]] = {r.request_id: {} for r in heads}
    for r in heads:
        first = _first_row(r)  # M_S's extension starts at that row, an oracle's at row 0
        for level, ext, offset in ((0, small[r.request_id], first), (top, large.get(r.request_id), 0)):
            rows = [first + i for i, lv in enumerate(levels[r.request_id]) if lv == level]
            if ext is not None and rows:
                targets = tuple(r.request.prompt_ids[j + 1] for j in rows)
                logits = ext.logits[[j - offset for j in rows]]
                scored[r.request_id][level] = (rows, score_rows(logits, targets, _top_n(r)))
    for level in range(1, len(models)):
        # requests with rows routed here, and eager sessions with none (a plain prefill)
        group_l, scoring = [], []
        for r in heads:
            if level in scored[r.request_id] or (level == top and r.request_id in large):
                continue
            rows = [_first_row(r) + i for i, lv in enumerate(levels[r.request_id]) if lv == level]
            if rows or level in r.opened:
                _open(models[level], level, r)
                group_l.append(r)
                targets = tuple(r.request.prompt_ids[j + 1] for j in rows)
                scoring.append(Scoring(tuple(rows), targets, _top_n(r)) if rows else None)
        exts = _extend(models[level], level, group_l, last_only=True, scoring=scoring)
        for r, sc, ext in zip(group_l, scoring, exts):
            if sc is not None:
                if ext.scored is None or len(ext.scored.target) != len(sc.rows):
                    raise RuntimeError(f"{models[level].name}: no scored rows for {r.request_id!r}")
                scored[r.request_id][level] = (list(sc.rows), ext.scored)
    for r in group:
        _entries(r, levels.get(r.request_id, []), scored.get(r.request_id, {}), texts, decode)


def adopt_prefix(model: Backend, r: Live, ids, now: bool = False) -> int:
    """Positions of r's fresh session at `model` loaded from its prefix cache (the model's
    next extend feeds ids[n:]); 0 when r or the model has no prefix cache. Only a prompt is
    cached: a catch-up passes every token, the prompt's length bounds what is looked up.
    now: the count is needed before the next extend (chunked prefill feeds from it), so a
    remote model looks up at once (`load_prefix`: a round trip) instead of in that extend."""
    adopt = getattr(model, "load_prefix" if now else "adopt_prefix", None) or getattr(model, "adopt_prefix", None)
    if adopt is None or not r.request.routing.prefix_cache:
        return 0
    return adopt(r.request_id, ids, r.prompt_len)


def _top_n(r: Live) -> int:
    return int(r.request.sampling.prompt_logprobs or 0)


def _first_row(r: Live) -> int:
    """The first prompt row scored (row j predicts prompt token j + 1; the head has
    prompt_len - 1 rows, and at least its last is scored)."""
    return min(r.request.sampling.prompt_logprobs_from, r.prompt_len - 1) - 1


@torch.inference_mode()
def _levels(r: Live, small: Extension, large: Extension | None) -> list[int]:
    """The level of each scored row of r's prompt head (rows first.. of it, first =
    _first_row(r)): what r's router decides from M_S's state on the true prefix (row j
    predicts prompt token j + 1). small covers those rows, large (an oracle's) every row."""
    first = _first_row(r)
    n = r.prompt_len - 1 - first
    ctx = StepContext(
        small_logits=small.logits,  # [n, V]
        hidden=small.hidden if r.router.hidden_layer is not None else None,  # [n, d]
        large_logits=large.logits[first:] if large is not None else None,  # [n, V]
        drafts=torch.zeros(n, dtype=torch.long),
        uniforms=uniforms([r.seed] * n, range(first + 1, first + n + 1), Stream.ROUTER)[:, 0],  # position j + 1
    )
    scores = r.router.scores(ctx)  # [n]
    if scores.shape != (n,):
        raise RuntimeError(f"router {r.router.name} gave {tuple(scores.shape)} scores for {n} prompt rows")
    (values,) = to_host(scores)
    # level = how many of the request's thresholds (host floats, ascending) the score reaches
    return [sum(v >= t for t in r.thresholds) for v in values]


def _entries(
    r: Live, levels: list[int], scored: dict[int, tuple[list[int], Scored]], texts: TokenTexts, decode: Callable
) -> None:
    """r.prompt_scores from the scored rows of every level."""
    prompt = r.request.prompt_ids
    text, offsets = prompt_offsets(prompt, texts, decode)

    entry = texts.logprob

    rows: dict[int, TokenLogprobs] = {}
    for rows_l, s in scored.values():
        target, top_ids, top = s.target.tolist(), s.top_ids.tolist(), s.top.tolist()
        for n, j in enumerate(rows_l):
            rows[j] = TokenLogprobs(
                chosen=entry(prompt[j + 1], target[n]),
                top=tuple(entry(i, v) for i, v in zip(top_ids[n], top[n])),
                text_offset=offsets[j + 1],
            )
    first = _first_row(r) if len(prompt) > 1 else 0
    if len(rows) != len(prompt) - 1 - first:
        raise RuntimeError(f"{len(prompt) - 1 - first - len(rows)} prompt rows of {r.request_id!r} were not scored")
    unscored = [None] * (first + 1)  # the first token, and those before prompt_logprobs_from
    logprobs = [*unscored, *(rows[j] for j in range(first, len(prompt) - 1))]
    r.prompt_scores = PromptScores(logprobs, [*unscored, *levels], text)


def prompt_offsets(prompt: Sequence[int], texts: TokenTexts, decode: Callable) -> tuple[str, list[int]]:
    """(the decoded prompt, where each token's text starts in it, in characters). A token
    that starts inside a multi-byte character starts where that character does (as the
    offsets of generated tokens do)."""
    text = decode(list(prompt))
    raw = [texts(t)[1] for t in prompt]
    joined = b"".join(raw)
    try:
        exact = joined.decode("utf-8") == text
    except UnicodeDecodeError:
        exact = False
    if not exact:  # the decoder adds or drops text (spaces, special tokens): decode each prefix
        return text, [len(decode(list(prompt[:i])).rstrip("\ufffd")) for i in range(len(prompt))]
    offsets, chars, at = [], 0, 0  # chars: characters that start in joined[:at]
    for piece in raw:
        inside = at < len(joined) and (joined[at] & 0xC0) == 0x80  # a continuation byte: mid-character
        offsets.append(chars - 1 if inside else chars)
        chars += sum(1 for b in piece if (b & 0xC0) != 0x80)
        at += len(piece)
    return text, offsets
