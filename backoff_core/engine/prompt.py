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
from dataclasses import dataclass, field

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


@dataclass
class ScoringProgress:
    """A prompt being scored (Live.scoring): the rows scored so far, a window per step where
    it is chunked. Rows first.. are scored (row j predicts prompt token j + 1)."""

    first: int  # the first scored row (_first_row)
    text: str  # the decoded prompt, which the entries' text offsets index
    offsets: list[int]  # per prompt token: where its text starts in `text`
    levels: list[int] = field(default_factory=list)  # per row scored so far, from `first`
    entries: dict[int, TokenLogprobs] = field(default_factory=dict)  # row -> its entry

    @classmethod
    def start(cls, r: Live, texts: TokenTexts, decode: Callable) -> ScoringProgress:
        text, offsets = prompt_offsets(r.request.prompt_ids, texts, decode)
        return cls(_first_row(r) if r.prompt_len > 1 else 0, text, offsets)

    def add(self, rows: list[int], scored: Scored, r: Live, texts: TokenTexts) -> None:
        """The entries of `rows`, scored by one level (s: their target and top-n)."""
        prompt, entry = r.request.prompt_ids, texts.logprob
        target, top_ids, top = scored.target.tolist(), scored.top_ids.tolist(), scored.top.tolist()
        for n, j in enumerate(rows):
            self.entries[j] = TokenLogprobs(
                chosen=entry(prompt[j + 1], target[n]),
                top=tuple(entry(i, v) for i, v in zip(top_ids[n], top[n])),
                text_offset=self.offsets[j + 1],
            )

    def scores(self, r: Live) -> PromptScores:
        """r.prompt_scores once every row is scored; the first token, and those before
        prompt_logprobs_from, have none."""
        rows = range(self.first, r.prompt_len - 1)
        if len(self.entries) != len(rows) or len(self.levels) != len(rows):
            raise RuntimeError(f"{len(rows) - len(self.entries)} prompt rows of {r.request_id!r} were not scored")
        unscored = [None] * (self.first + 1)
        return PromptScores([*unscored, *(self.entries[j] for j in rows)], [*unscored, *self.levels], self.text)


# where the decoder's text is not the tokens' bytes joined: a prompt up to EXACT_OFFSETS tokens
# decodes each prefix (quadratic: 8,000 tokens took 11 s, holding the step loop); a longer one
# adds each token's share of a decode of the OFFSET_WINDOW tokens before it (the same
# wherever decoding is local, as streaming detokenizers assume)
EXACT_OFFSETS = 512
OFFSET_WINDOW = 8
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
    ends: dict[str, int] | None = None,
) -> list[Extension]:
    """One forward over the prompt heads of `group` at `level` (sessions open), each up to
    ends[r] positions (default: the whole head); one extension per request of `group` that
    had anything to feed, in order (with `scoring`: the requests given, every one of which
    has a row to feed)."""
    end = {r.request_id: (r.prompt_len - 1 if ends is None else ends[r.request_id]) for r in group}
    keep = [i for i, r in enumerate(group) if r.fed[level] < end[r.request_id]]  # a whole head adopted: nothing
    group = [group[i] for i in keep]
    if not group:
        return []
    items = [(r.request_id, _head(r)[r.fed[level] : end[r.request_id]]) for r in group]
    if scoring is not None and any(scoring[i] is not None for i in keep):
        scoring = [scoring[i] for i in keep]
        exts = model.extend(items, hidden_layer=hidden_layer, last_only=last_only, scoring=scoring)
    else:  # no scoring argument: any Backend takes this call
        exts = model.extend(items, hidden_layer=hidden_layer, last_only=last_only)
    for r in group:
        r.fed[level] = end[r.request_id]
    return exts


def _score(models: Sequence[Backend], group: list[Live], texts: TokenTexts, decode: Callable) -> None:
    """Prompt logprobs of `group` at admission: every row in one window."""
    for r in group:
        r.scoring = ScoringProgress.start(r, texts, decode)
    score_window(models, group, texts, decode, rows=None)


def start_scoring(models: Sequence[Backend], r: Live, texts: TokenTexts, decode: Callable) -> None:
    """At admission, a prompt scored over several steps (chunked): its sessions opened (M_S;
    eager levels, oracles), its progress started; stage 0 of the steps scores its rows."""
    for level, model in enumerate(models):
        if level == 0 or prefills_large(r):
            _open(model, level, r)
    r.scoring = ScoringProgress.start(r, texts, decode)


def score_window(
    models: Sequence[Backend], group: list[Live], texts: TokenTexts, decode: Callable, rows: int | None
) -> None:
    """The next rows of `group`'s prompts scored, `rows` of them in all (oldest request first;
    None: every row): M_S over them, the router's level per row, each level's scored rows.
    A request whose last row is scored gets its prompt_scores (r.scoring: None again); every
    level it opened then holds its prompt head, as after a prefill."""
    top = len(models) - 1
    heads = [r for r in group if r.prompt_len > 1]
    layers = {r.router.hidden_layer for r in heads} - {None}
    if len(layers) > 1:
        raise ValueError("one batch cannot serve classifier heads over different layers")
    layer = next(iter(layers), None)
    # rows before a request's first scored one (prompt_logprobs_from - 1): a plain prefill
    # of M_S first, then M_S's logits over the scored rows alone
    ahead = [r for r in heads if r.fed[0] < _first_row(r)]
    if ahead:
        models[0].extend([(r.request_id, _head(r)[r.fed[0] : _first_row(r)]) for r in ahead], last_only=True)
        for r in ahead:
            r.fed[0] = _first_row(r)
    ends, budget = {}, rows  # the window of r: rows r.fed[0] .. ends[r] - 1
    for r in heads:
        if budget is None or budget > 0:
            ends[r.request_id] = r.prompt_len - 1 if budget is None else min(r.prompt_len - 1, r.fed[0] + budget)
            budget = None if budget is None else budget - (ends[r.request_id] - r.fed[0])
    now = [r for r in heads if r.request_id in ends]
    los = {r.request_id: r.fed[0] for r in now}
    items = [(r.request_id, _head(r)[r.fed[0] : ends[r.request_id]]) for r in now]
    small = dict(zip(los, models[0].extend(items, hidden_layer=layer, last_only=False))) if now else {}
    for r in now:
        r.fed[0] = ends[r.request_id]
    # oracles: the largest model scores every row of the window against M_S's logits there
    # (Scoring.against: the KL a row, the target, the top-n; its session is at row 0 first),
    # in pieces of at most max_logit_rows rows where M_S's logits cross a wire
    large = _score_against(models[top], top, [r for r in now if r.router.needs_large_logits], ends, los, small)
    routed: dict[str, dict[int, list[int]]] = {}  # request id -> level -> its rows in the window
    for r in now:
        lo, progress, oracle = los[r.request_id], r.scoring, large.get(r.request_id)
        levels = _levels(r, small[r.request_id], None if oracle is None else oracle.kl, lo)
        progress.levels.extend(levels)
        routed[r.request_id] = {}
        for i, lv in enumerate(levels):
            routed[r.request_id].setdefault(lv, []).append(lo + i)
        if rows_s := routed[r.request_id].get(0):
            targets = tuple(r.request.prompt_ids[j + 1] for j in rows_s)
            logits = small[r.request_id].logits[[j - lo for j in rows_s]]
            progress.add(rows_s, score_rows(logits, targets, _top_n(r)), r, texts)
        if oracle is not None and (rows_l := routed[r.request_id].get(top)):
            progress.add(rows_l, oracle.take([j - lo for j in rows_l]), r, texts)
    for level in range(1, len(models)):
        # requests with rows routed here, and open sessions with none (kept level with the window)
        group_l, scoring = [], []
        for r in now:
            rows_l = routed[r.request_id].get(level, [])
            if (level == top and r.request_id in large) or not (rows_l or level in r.opened):
                continue
            _open(models[level], level, r)
            group_l.append(r)
            at = r.fed[level]  # Scoring rows index the extend's new ids, which start there
            targets = tuple(r.request.prompt_ids[j + 1] for j in rows_l)
            scoring.append(Scoring(tuple(j - at for j in rows_l), targets, _top_n(r)) if rows_l else None)
        exts = _extend(models[level], level, group_l, last_only=True, scoring=scoring, ends=ends)
        for r, sc, ext in zip(group_l, scoring, exts):
            if sc is not None:
                if ext.scored is None or len(ext.scored.target) != len(sc.rows):
                    raise RuntimeError(f"{models[level].name}: no scored rows for {r.request_id!r}")
                r.scoring.add(routed[r.request_id][level], ext.scored, r, texts)
    for r in group:
        if r.prompt_len <= 1 or r.fed[0] >= r.prompt_len - 1:
            r.prompt_scores = r.scoring.scores(r)
            r.scoring = None


def _score_against(
    model: Backend, level: int, group: list[Live], ends: dict[str, int], los: dict[str, int], small: dict
) -> dict[str, Scored]:
    """request id -> `model`'s scored rows los[r] .. ends[r] - 1 of r's head, each with its
    KL(model || M_S) (Scoring.against: small[r]'s logits, which start at row los[r]); r's
    session is fed up to ends[r] from wherever it was (rows before los[r] unscored), with at
    most `model.max_logit_rows` scored rows a call (None: one forward), so no call carries
    more of M_S's rows, and a reply is a few numbers a row, never a logits row."""
    piece = getattr(model, "max_logit_rows", None)
    parts: dict[str, list[Scored]] = {r.request_id: [] for r in group}
    done = dict(los)  # per request: its first row not scored yet
    while short := [r for r in group if r.fed[level] < ends[r.request_id]]:
        cut, scoring = {}, []
        for r in short:
            at, lo = r.fed[level], done[r.request_id]
            if at > lo:
                raise RuntimeError(f"{model.name} holds {at} rows of {r.request_id!r}, ahead of M_S's {lo}")
            end = cut[r.request_id] = ends[r.request_id] if piece is None else min(ends[r.request_id], lo + piece)
            # [m, V]; a copy: a view would pickle the whole window's storage onto the wire
            against = small[r.request_id].logits[lo - los[r.request_id] : end - los[r.request_id]].clone()
            targets = tuple(r.request.prompt_ids[j + 1] for j in range(lo, end))
            scoring.append(Scoring(tuple(range(lo - at, end - at)), targets, _top_n(r), against))
            done[r.request_id] = end
        exts = _extend(model, level, short, last_only=True, scoring=scoring, ends=cut)
        for r, sc, ext in zip(short, scoring, exts):
            if ext.scored is None or ext.scored.kl is None or len(ext.scored.kl) != len(sc.rows):
                raise RuntimeError(f"{model.name}: no KL of the scored rows of {r.request_id!r}")
            parts[r.request_id].append(ext.scored)
    return {request_id: Scored.cat(p) for request_id, p in parts.items() if p}


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
def _levels(r: Live, small: Extension, kl: torch.Tensor | None, lo: int) -> list[int]:
    """The level of each row of r's prompt head in a window starting at row `lo`: what r's
    router decides from M_S's state on the true prefix (row j predicts prompt token j + 1).
    small covers the window's rows, kl (an oracle's KL(M_L || M_S), [n]) too."""
    n = small.logits.shape[0]
    ctx = StepContext(
        small_logits=small.logits,  # [n, V]
        hidden=small.hidden if r.router.hidden_layer is not None else None,  # [n, d]
        large_logits=None,
        drafts=torch.zeros(n, dtype=torch.long),
        uniforms=uniforms([r.seed] * n, range(lo + 1, lo + n + 1), Stream.ROUTER)[:, 0],  # position j + 1
        kl=kl,  # [n] or None
    )
    scores = r.router.scores(ctx)  # [n]
    if scores.shape != (n,):
        raise RuntimeError(f"router {r.router.name} gave {tuple(scores.shape)} scores for {n} prompt rows")
    (values,) = to_host(scores)
    # level = how many of the request's thresholds (host floats, ascending) the score reaches
    return [sum(v >= t for t in r.thresholds) for v in values]


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
    if not exact and len(prompt) <= EXACT_OFFSETS:  # the decoder adds or drops text: decode each prefix
        return text, [len(decode(list(prompt[:i])).rstrip("\ufffd")) for i in range(len(prompt))]
    if not exact:  # a long prompt: what token i adds to the text decoded from OFFSET_WINDOW tokens before it
        offsets, at = [0], 0
        for i in range(1, len(prompt)):
            window = list(prompt[max(0, i - OFFSET_WINDOW) : i])
            at += len(decode(window).rstrip("\ufffd")) - len(decode(window[:-1]).rstrip("\ufffd"))
            offsets.append(at)
        return text, offsets
    offsets, chars, at = [], 0, 0  # chars: characters that start in joined[:at]
    for piece in raw:
        inside = at < len(joined) and (joined[at] & 0xC0) == 0x80  # a continuation byte: mid-character
        offsets.append(chars - 1 if inside else chars)
        chars += sum(1 for b in piece if (b & 0xC0) != 0x80)
        at += len(piece)
    return text, offsets
