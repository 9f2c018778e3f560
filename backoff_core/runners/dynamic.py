"""One causal LM and the KV caches ("sessions") of the requests it serves.

The only operation is `extend`: append some new tokens to some sessions and return the
model's logits at every new position. For M_S that is one token per step; for M_L it is a
catch-up prefill over all pending tokens; for a new session it is the prompt prefill. Many
sessions extend in ONE forward: their caches are left-padded to a common past length and
their new tokens right-padded to a common count, with an attention mask that hides the
padding and position ids that carry each row's own positions, so ragged lengths give the
same result as running each session alone. Where one cache is much longer than the rest
the rows split into a few such forwards instead (`forward_groups`), so that the others do not
pay for its length.

`last_only=True` asks for the logits after the LAST new token only (all the step loop
needs unless it verifies or measures every position): the LM head then runs on one row
per session instead of k, through the model's own `logits_to_keep` where it has one.

KV budget (`kv_budget_tokens`, kv_budget.py): the runner counts the positions its sessions
hold. An extend that would pass the budget first evicts idle sessions (those not in the
extend), least recently used first; their owners find them gone (SessionError /
`lost`) and re-prefill them from the token ids they keep. When the extend's own sessions
alone pass the budget, a NEW session among them (nothing cached yet: a request's first
prefill) is refused with KVCapacityError before anything changes; sessions already held,
and re-prefills of evicted ones, are never refused (a live request grows past the budget
rather than fail), so the budget bounds what new requests may take, not a live one.
`evict_idle=False` (M_S: every live request extends it every step, and the step loop has no
way to rebuild an M_S session) never evicts: a new session is refused once the budget is full.

Prefix cache (prefix_cache.py, on by default): `adopt_prefix` starts a fresh session from
the longest cached prompt prefix (a new DynamicCache over copies of the blocks' K/V); the
positions it loads count against the KV budget like prefilled ones.
"""

from __future__ import annotations

import collections
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from backoff_core.errors import KVCapacityError
from backoff_core.runners.extension import Extension
from backoff_core.runners.prefix_cache import PrefixCache, PrefixCaching
from backoff_core.runners.scoring import Scoring, per_item, score_rows
from backoff_core.runners.sessions import Session, SessionTable
from backoff_core.types import PrefixCacheSpec

# [1, heads, length, head_dim] keys and values, one pair per layer
KV = list[tuple[torch.Tensor, torch.Tensor]]

# A padded forward copies every row's cache into one [B, H, P_max, D] tensor per layer and
# runs K_max query rows for every row, so one session much longer than the others (in cache
# or in new tokens) makes them all pay for its length. A split costs a forward (the weights
# read again, every op launched again). Measured on the default pair's M_L (CPU, one thread):
# 8 catch-ups of 2 tokens, one session at 2048 positions and seven at 60, took 1.2-2.3 s as
# one forward and 0.37-0.43 s as two (the long one alone, the seven together): a forward's
# fixed cost there is ~0.2 s, a padded cache position ~0.1 ms, a padded query row ~3 ms (a
# 256-position forward: ~0.76 s). In padded cache positions:
SPLIT_PAD_POSITIONS = 2048  # what a forward added must save
QUERY_ROW_POSITIONS = 32  # what a padded query row costs


def forward_groups(past_lens: list[int], new_lens: list[int], pad_cost: int = SPLIT_PAD_POSITIONS) -> list[list[int]]:
    """The forwards an extend of rows with these cached and new lengths runs, as row indices
    (each group in row order): one, unless splitting saves more than `pad_cost` padded
    positions per forward added. Groups are runs of the rows ordered by size (longest first),
    chosen by least total cost: pad_cost a forward plus its padding, (P_max - p) cache
    positions and QUERY_ROW_POSITIONS per padded query row (K_max - k) of every row."""
    n = len(past_lens)

    def padding(rows: list[int]) -> int:
        p_max, k_max = max(past_lens[i] for i in rows), max(new_lens[i] for i in rows)
        return sum(p_max - past_lens[i] + QUERY_ROW_POSITIONS * (k_max - new_lens[i]) for i in rows)

    if padding(list(range(n))) <= pad_cost:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: -(past_lens[i] + QUERY_ROW_POSITIONS * new_lens[i]))
    best, cut = [0] + [float("inf")] * n, [0] * (n + 1)  # best[j]: least cost of the first j rows
    for j in range(1, n + 1):
        p_max = k_max = p_sum = k_sum = 0
        for i in range(j - 1, -1, -1):  # rows order[i:j] in one forward, grown one row at a time
            p, k = past_lens[order[i]], new_lens[order[i]]
            p_max, k_max, p_sum, k_sum = max(p_max, p), max(k_max, k), p_sum + p, k_sum + k
            rows = j - i
            cost = best[i] + pad_cost + rows * p_max - p_sum + QUERY_ROW_POSITIONS * (rows * k_max - k_sum)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j:
        groups.append(sorted(order[cut[j] : j]))
        j = cut[j]
    return groups[::-1]


@dataclass
class _CachedSession(Session):
    cache: DynamicCache | None = None  # None: nothing cached yet

    @property
    def kv(self) -> KV:
        return [(layer.keys, layer.values) for layer in self.cache.layers]


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword of the KV cache in the model's forward and outputs: `cache` since
    transformers 5.24 (where `past_key_values` warns, and goes in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class ModelRunner(PrefixCaching, SessionTable[_CachedSession]):
    """Holds one model and its sessions. Thread-safe: one forward at a time."""

    split_pad_positions = SPLIT_PAD_POSITIONS  # see forward_groups

    def __init__(
        self,
        model: PreTrainedModel,
        name: str = "model",
        kv_budget_tokens: int | None = None,
        evict_idle: bool = True,
        prefix_cache: PrefixCacheSpec | None = PrefixCacheSpec(),
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.name = name
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.num_layers = int(model.config.num_hidden_layers)
        self.forward_passes = 0
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kw = cache_keyword(model)
        self.kv_budget_tokens = kv_budget_tokens  # None: unbounded
        self.evict_idle = evict_idle
        self.evictions = 0  # idle sessions freed to make room
        self._evicted: collections.OrderedDict[str, None] = collections.OrderedDict()  # recent (bounded)
        self.prefix_cache = PrefixCache(prefix_cache or PrefixCacheSpec(0))  # None: off

    # -- sessions (sessions.SessionTable) ---------------------------------------------------
    def _new_session(self, request_id: str, refill: bool) -> _CachedSession:
        # reopened after an eviction: a rebuild, never refused for the budget
        return _CachedSession(refill=refill or self._evicted.pop(request_id, 0) is None)

    def _crop(self, session: _CachedSession, length: int) -> None:
        self._crop_prefix(session, length)
        if session.cache is not None and length < session.length:
            for layer in session.cache.layers:  # views: no copy
                layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]

    # -- KV budget ------------------------------------------------------------------------
    @property
    def kv_tokens(self) -> int:
        """Positions held by all sessions."""
        with self._lock:
            return sum(s.length for s in self._sessions.values())

    def kv_fits(self, items: list[tuple[str, int]]) -> bool:
        """Whether these sessions, each grown by its count of new positions, fit the budget
        together (every other session evicted if need be)."""
        if self.kv_budget_tokens is None:
            return True
        with self._lock:
            return sum(self._get(request_id).length + n for request_id, n in items) <= self.kv_budget_tokens

    def _reserve(self, items: list[tuple[str, list[int]]]) -> list[str]:
        """Room in the budget for this extend (under the lock): refuse a new session that
        does not fit beside the extend's others, else evict idle sessions LRU; their ids."""
        budget = self.kv_budget_tokens
        need = sum(len(ids) for _, ids in items)
        used = sum(s.length for s in self._sessions.values())
        if budget is None or used + need <= budget:
            return []
        fresh = [
            request_id
            for request_id, _ in items
            # a new session: nothing but what it adopted from the prefix cache yet
            if self._sessions[request_id].length == self._sessions[request_id].adopted
            and not self._sessions[request_id].refill
        ]
        if fresh and (not self.evict_idle or not self.kv_fits([(request_id, len(ids)) for request_id, ids in items])):
            raise KVCapacityError(
                f"{self.name}: no KV room for a new session: the live sessions alone would hold more than "
                f"kv_budget_tokens={budget} positions; retry when a request ends"
            )
        if not self.evict_idle:
            return []
        extending = {request_id for request_id, _ in items}
        idle = sorted(
            (s.last_used, request_id)
            for request_id, s in self._sessions.items()
            if request_id not in extending and s.length
        )
        evicted = []
        for _, request_id in idle:
            if used + need <= budget:
                break
            used -= self._sessions.pop(request_id).length
            evicted.append(request_id)
            self._evicted[request_id] = None
        while len(self._evicted) > 65536:
            self._evicted.popitem(last=False)
        self.evictions += len(evicted)
        return evicted

    # -- forward --------------------------------------------------------------------------
    @torch.inference_mode()
    def extend(
        self,
        items: list[tuple[str, list[int]]],
        hidden_layer: int | None = None,
        last_only: bool = False,
        scoring: Sequence[Scoring | None] | None = None,
    ) -> list[Extension]:
        """Append tokens to sessions in one forward; returns one Extension per item (its
        logits at every new position, or at the last one only). scoring: per item, rows to
        score (scoring.py); the LM head then runs on those rows (and the last) only."""
        if not items:
            return []
        scoring = per_item(self.name, items, scoring, self.vocab_size)
        with self._lock:
            sessions = self._extending(items)
            self._reserve(items)
            groups = forward_groups(
                [s.length for s in sessions], [len(ids) for _, ids in items], self.split_pad_positions
            )
            out: list[Extension] = [None] * len(items)  # type: ignore[list-item]
            for g in groups:
                if len(g) == 1:
                    (i,) = g
                    exts = self._extend_one(sessions[i], items[i][1], hidden_layer, last_only, scoring[i])
                else:
                    exts = self._extend_batch(
                        [sessions[i] for i in g],
                        [items[i][1] for i in g],
                        hidden_layer,
                        last_only,
                        [scoring[i] for i in g],
                    )
                for i, ext in zip(g, exts):
                    out[i] = ext
            self.forward_passes += len(groups)
            now = time.monotonic()
            for s in sessions:
                s.last_used = now
            self._remember(sessions, [ids for _, ids in items])
            return out

    # -- prefix cache (prefix_cache.PrefixCaching) ----------------------------------------
    def _read_kv(self, s: _CachedSession, start: int, stop: int) -> torch.Tensor:
        # [layers, 2, kv_heads, stop - start, head_dim], a copy (stack)
        return torch.stack([torch.stack((k[0, :, start:stop], v[0, :, start:stop])) for k, v in s.kv])

    def _write_kv(self, s: _CachedSession, kv: torch.Tensor) -> None:
        kv = kv.to(self.device)
        s.cache = DynamicCache(ddp_cache_data=[(layer[0][None], layer[1][None]) for layer in kv])

    def _room(self, request_id: str, s: _CachedSession, n: int) -> bool:
        try:
            self._reserve([(request_id, [0] * n)])
        except KVCapacityError:
            return False
        return True

    def _forward(self, input_ids, past: DynamicCache, hidden_layer, keep=None, **kwargs):
        """keep: the positions (ints, or -1 for the last) whose logits are wanted; None: all."""
        if keep is not None and self._keeps_logits:
            kwargs["logits_to_keep"] = 1 if keep == -1 else torch.tensor(keep, device=self.device)
        return self.model(
            input_ids=input_ids,
            **{self._cache_kw: past},
            use_cache=True,
            output_hidden_states=hidden_layer is not None,
            **kwargs,
        )

    def _extend_one(
        self, s: _CachedSession, ids: list[int], hidden_layer: int | None, last_only: bool, scoring: Scoring | None
    ) -> list[Extension]:
        # Fast path: no padding, no mask, the session's own cache extended in place by HF.
        if s.cache is None:
            s.cache = DynamicCache()
        k = len(ids)
        input_ids = torch.tensor([ids], device=self.device)  # [1, k]
        position_ids = torch.arange(s.length, s.length + k, device=self.device)[None]
        keep = _keep([k], last_only, [scoring])
        out = self._forward(input_ids, s.cache, hidden_layer, keep, position_ids=position_ids)
        s.length += k
        hidden = out.hidden_states[hidden_layer][0] if hidden_layer is not None else None
        return [_extension(out.logits[0], _kept(out.logits, keep, k), k, last_only, hidden, scoring)]

    def _extend_batch(
        self,
        sessions: list[_CachedSession],
        new_ids: list[list[int]],
        hidden_layer: int | None,
        last_only: bool,
        scoring: list[Scoring | None],
    ) -> list[Extension]:
        past_lens = [s.length for s in sessions]
        new_lens = [len(ids) for ids in new_ids]
        b, p_max, k_max = len(sessions), max(past_lens), max(new_lens)
        dev = self.device
        # mask: [B, P + K]; row i sees its own past (right-aligned) and its k_i new tokens
        mask = torch.zeros(b, p_max + k_max, dtype=torch.long, device=dev)
        input_ids = torch.zeros(b, k_max, dtype=torch.long, device=dev)  # [B, K]
        position_ids = torch.zeros(b, k_max, dtype=torch.long, device=dev)  # [B, K]
        for i, (p, ids) in enumerate(zip(past_lens, new_ids)):
            mask[i, p_max - p : p_max + len(ids)] = 1
            input_ids[i, : len(ids)] = torch.tensor(ids, device=dev)
            position_ids[i] = torch.arange(p, p + k_max, device=dev)
        past = DynamicCache(ddp_cache_data=self._left_pad(sessions, p_max)) if p_max else DynamicCache()
        # the columns any row wants (new tokens are right-padded: a row's last sits at k_i - 1)
        keep = _keep(new_lens, last_only, scoring)
        out = self._forward(input_ids, past, hidden_layer, keep, attention_mask=mask, position_ids=position_ids)
        kept = _kept(out.logits, keep, k_max)
        layers = getattr(out, self._cache_kw).layers
        results = []
        for i, (s, p, k) in enumerate(zip(sessions, past_lens, new_lens)):
            lo, hi = p_max - p, p_max + k
            s.cache = DynamicCache(
                ddp_cache_data=[
                    (layer.keys[i : i + 1, :, lo:hi], layer.values[i : i + 1, :, lo:hi]) for layer in layers
                ]
            )
            s.length = p + k
            hidden = out.hidden_states[hidden_layer][i, :k] if hidden_layer is not None else None
            results.append(_extension(out.logits[i], kept, k, last_only, hidden, scoring[i]))
        return results

    def _left_pad(self, sessions: list[_CachedSession], p_max: int) -> KV:
        """Stack the sessions' caches into [B, H, P, D] per layer, right-aligned."""
        kvs = [s.kv if s.cache is not None and s.length else None for s in sessions]
        template = next(kv for kv in kvs if kv is not None)
        padded: KV = []
        for layer, (k0, v0) in enumerate(template):
            shape_k = (len(sessions), k0.shape[1], p_max, k0.shape[3])
            shape_v = (len(sessions), v0.shape[1], p_max, v0.shape[3])
            keys = k0.new_zeros(shape_k)
            values = v0.new_zeros(shape_v)
            for i, (s, kv) in enumerate(zip(sessions, kvs)):
                if kv is not None:
                    keys[i, :, p_max - s.length :] = kv[layer][0][0]
                    values[i, :, p_max - s.length :] = kv[layer][1][0]
            padded.append((keys, values))
        return padded


def _keep(new_lens: list[int], last_only: bool, scoring: list[Scoring | None]) -> int | list[int] | None:
    """The columns whose logits a forward must compute: None (all), -1 (each row's last, one
    row) or a sorted list shared by the batch's rows (each row's last and its scored rows)."""
    if not last_only:
        return None
    if all(sc is None for sc in scoring):
        return -1 if len(new_lens) == 1 else sorted({k - 1 for k in new_lens})
    rows = {k - 1 for k in new_lens}
    for sc in scoring:
        rows.update(sc.rows if sc is not None else ())
    return sorted(rows)


def _kept(logits: torch.Tensor, keep, k: int) -> list[int] | None:
    """The new-id row of each computed logits column ([B, C, V]; keep -1: one row of k new
    ids); None: every row (the model computed all, as it does without logits_to_keep)."""
    if keep is None:
        return None
    columns = [k - 1] if keep == -1 else keep
    return columns if logits.shape[1] == len(columns) else None


def _extension(
    logits: torch.Tensor, kept: list[int] | None, k: int, last_only: bool, hidden, scoring: Scoring | None
) -> Extension:
    """One row's Extension from its computed logits [C, V] (columns `kept`, None: all)."""
    where = {c: n for n, c in enumerate(kept)} if kept is not None else None

    def rows(wanted: list[int]) -> torch.Tensor:
        return logits[wanted if where is None else [where[j] for j in wanted]]

    out = rows([k - 1]) if last_only else logits[:k]
    scored = (
        score_rows(rows(list(scoring.rows)), scoring.targets, scoring.top_n, scoring.against)
        if scoring is not None
        else None
    )
    return Extension(out.float(), hidden, scored)


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call, synchronising CUDA so the time is the real one."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start
