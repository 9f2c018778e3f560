"""Prefix cache: the KV of prompt blocks seen before, shared by every session of one model.

A prompt is cut into blocks of B tokens (`block_tokens`). Block i's key chains the key of
block i-1 with its own ids, key_i = hash((key_{i-1}, ids_i)), so a key names the WHOLE prefix
up to its block (the vLLM automatic-prefix-caching scheme); each entry keeps its parent key
and ids too, so a hash collision reads as a miss, never as someone else's KV. A value is the
block's K/V [layers, 2, kv_heads, B, head_dim], COPIED out of the session that computed it:
closing or evicting that session never touches the cache, and adopting a prefix copies the
blocks into the new session's own storage (per-session caches or a static slot).

Bounded by `budget_tokens` (a multiple of B in use), LRU. A lookup or a store touches its chain
leaf first, root last, so a parent is always more recent than its children and eviction takes
leaves first: no block is ever left unreachable behind an evicted parent. A store evicts only
blocks outside its own chain; when only its chain is left (a prefix longer than the budget) it
stops storing. The cache never refuses a request: a full cache evicts, a miss prefills.

`PrefixCaching` is the runner side (dynamic.ModelRunner, static.StaticRunner): `adopt_prefix`
loads the longest cached prefix into a FRESH session, and every extend stores the full blocks
its sessions now hold, up to the cacheable length the adopt named (a prompt, never generated
tokens). A catch-up never needs it otherwise: M_L's lagging cache is per request already.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from backoff_core.types import PrefixCacheSpec


@dataclass(frozen=True)
class PrefixCacheStats:
    lookups: int = 0  # adopt_prefix calls with the cache on
    hits: int = 0  # lookups that loaded at least one block
    misses: int = 0  # lookups that loaded none
    cached_tokens: int = 0  # positions loaded from the cache (prefill skipped)
    lookup_tokens: int = 0  # cacheable positions the lookups asked about
    stored_blocks: int = 0
    evicted_blocks: int = 0
    tokens: int = 0  # positions held now (blocks x B)
    budget_tokens: int = 0


@dataclass(frozen=True)
class _Block:
    parent: int | None
    ids: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, kv_heads, B, head_dim]


class PrefixCache:
    """Hash-chained blocks of prompt KV, LRU within `budget_tokens`. Not thread-safe: the
    runner calls it under its lock."""

    def __init__(self, spec: PrefixCacheSpec) -> None:
        self.block_tokens = spec.block_tokens
        self.capacity = spec.budget_tokens // spec.block_tokens  # blocks
        self._blocks: collections.OrderedDict[int, _Block] = collections.OrderedDict()  # LRU first
        self._counts = collections.Counter()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._blocks)

    @staticmethod
    def key(parent: int | None, ids: tuple[int, ...]) -> int:
        return hash((parent, ids))

    def match(self, ids: Sequence[int], limit: int) -> tuple[list[int], torch.Tensor | None]:
        """The keys of the longest chain of cached full blocks within ids[:limit], touched, and
        their K/V concatenated [layers, 2, kv_heads, n * B, head_dim] (a copy); ([], None): none."""
        b, keys, parent = self.block_tokens, [], None
        for start in range(0, limit - b + 1, b):
            block = tuple(ids[start : start + b])
            key = self.key(parent, block)
            entry = self._blocks.get(key)
            if entry is None or entry.parent != parent or entry.ids != block:
                break
            keys.append(key)
            parent = key
        if not keys:
            return [], None
        self._touch(keys)
        blocks = [self._blocks[k].kv for k in keys]
        if blocks[0].is_cuda:
            # a block stored on another CUDA stream (by a catch-up in flight, engine/flight.py)
            # and evicted later must not be reused before this stream's read of it is done
            # (PyTorch's rule for a tensor used on a stream it was not allocated on; a no-op
            # on the stream that allocated it)
            stream = torch.cuda.current_stream(blocks[0].device)
            for kv in blocks:
                kv.record_stream(stream)
        return keys, torch.cat(blocks, dim=3)

    def record(self, looked_up: int, loaded: int) -> None:
        self._counts["lookups"] += 1
        self._counts["hits" if loaded else "misses"] += 1
        self._counts["cached_tokens"] += loaded
        self._counts["lookup_tokens"] += looked_up

    def store(self, chain: list[int], ids: tuple[int, ...], kv: torch.Tensor) -> int | None:
        """Store the block after `chain` (the keys of the blocks before it); its key, or None
        when only `chain` itself could be evicted to make room (the caller stops there)."""
        parent = chain[-1] if chain else None
        key = self.key(parent, ids)
        entry = self._blocks.get(key)
        if entry is not None:  # another session stored it first (or a collision: keep the older)
            if entry.parent != parent or entry.ids != ids:
                return None
            self._touch([*chain, key])
            return key
        if not self._make_room(set(chain)):
            return None
        self._blocks[key] = _Block(parent, ids, kv)
        self._counts["stored_blocks"] += 1
        self._touch([*chain, key])
        return key

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            **self._counts,
            tokens=len(self._blocks) * self.block_tokens,
            budget_tokens=self.capacity * self.block_tokens,
        )

    def clear(self) -> None:
        self._blocks.clear()

    def _touch(self, chain: list[int]) -> None:
        for key in reversed(chain):  # leaf first, root last: the root ends most recent
            self._blocks.move_to_end(key)

    def _make_room(self, protected: set[int]) -> bool:
        if len(self._blocks) < self.capacity:
            return True
        for key in self._blocks:  # least recent first
            if key not in protected:
                del self._blocks[key]
                self._counts["evicted_blocks"] += 1
                return True
        return False


@dataclass
class PrefixTrack:
    """What a session stores as it grows: its ids from position 0 up to `limit` (whole
    blocks of its cacheable prefix) and the keys of its blocks already in the cache."""

    limit: int
    ids: list[int] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)


class PrefixCaching:
    """Runner mixin (under the runner's `_lock`). The runner provides `_sessions`, `_get`, and
    `_read_kv(session, start, stop)` -> [layers, 2, kv_heads, stop - start, head_dim] (a copy),
    `_write_kv(session, kv)` (positions 0..n of a fresh session) and `_room(request_id, session,
    n)` (its KV budget or slot for n positions, False when there is none)."""

    prefix_cache: PrefixCache

    def adopt_prefix(self, request_id: str, ids: Sequence[int], cacheable: int | None = None) -> int:
        """Load the longest cached prefix of `ids` (the tokens the FRESH session will hold; its
        next extends feed ids[n:]) into the session and return n, the positions loaded: whole
        blocks within ids[:cacheable] (default all), never all of ids (the caller feeds at
        least one token, whose logits it reads). From now on the session's extends store its
        full blocks of its first `cacheable` positions (the prompt, which may be longer than
        ids: a chunk). 0: off, a miss, or no KV room for them."""
        cache = self.prefix_cache
        if not cache.enabled:
            return 0
        with self._lock:
            s = self._get(request_id)
            if s.length != 0:
                raise ValueError(f"{self.name}: adopt_prefix needs a fresh session, {request_id!r} holds {s.length}")
            # cacheable may pass len(ids): a prompt fed in chunks is stored as its chunks come
            cacheable = len(ids) if cacheable is None else max(0, cacheable)
            b = cache.block_tokens
            limit = min(cacheable, len(ids) - 1, self._adoptable())
            keys, kv = cache.match(ids, limit)
            n = len(keys) * b
            if n and not self._room(request_id, s, n):
                keys, kv, n = [], None, 0
            cache.record(min(cacheable, len(ids)), n)
            if n:
                self._write_kv(s, kv)
                s.length = s.adopted = n
            s.prefix = PrefixTrack(cacheable - cacheable % b, list(ids[:n]), keys) if cacheable >= b else None
            return n

    def prefix_stats(self) -> PrefixCacheStats:
        with self._lock:
            return self.prefix_cache.stats()

    def _adoptable(self) -> int:
        """Positions one session may load (static slots: one below a slot's capacity)."""
        return 1 << 62

    def _remember(self, sessions: Sequence, new_ids: Sequence[Sequence[int]]) -> None:
        """After an extend: store the full blocks its tracked sessions now hold (a copy each)."""
        b = self.prefix_cache.block_tokens
        for s, ids in zip(sessions, new_ids):
            track = s.prefix
            if track is None:
                continue
            if len(track.ids) + len(ids) != s.length:
                s.prefix = None  # positions this track did not see: stop rather than store a guess
                continue
            track.ids.extend(ids[: track.limit - len(track.ids)])
            while (len(track.chain) + 1) * b <= len(track.ids):
                start = len(track.chain) * b
                block = tuple(track.ids[start : start + b])
                key = self.prefix_cache.store(track.chain, block, self._read_kv(s, start, start + b))
                if key is None:  # no room but its own chain: the rest of this prefix is not kept
                    s.prefix = None
                    break
                track.chain.append(key)
            if s.prefix is not None and len(track.chain) * b >= track.limit:
                s.prefix = None  # every cacheable block is in: nothing more to watch

    def _crop_prefix(self, s, length: int) -> None:
        """A rollback to `length` positions: the track forgets what it saw past it."""
        track = s.prefix
        if track is not None and len(track.ids) > length:
            del track.ids[length:]
            del track.chain[length // self.prefix_cache.block_tokens :]
