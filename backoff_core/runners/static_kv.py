"""Preallocated KV storage for one model: fixed slots, one per session, written in place.

Every layer owns a K and a V tensor [slots, kv_heads, max_len, head_dim], allocated once
in the model's dtype on its device, as views of one `storage` tensor
[layers, 2, slots, kv_heads, max_len, head_dim]: a slot's prefix over every layer is one
slice of it, so loading a cached prefix or copying one out is one kernel, not two a layer
(at the 8B shape 64 launches, ~1 ms of the host's time a request on the H100).
A session owns one slot (a row) for its whole life; its length says how many leading
positions are real. Nothing is ever concatenated, re-padded or cleared:
  - extend writes the new keys/values at each row's own positions (static_forward.py);
  - crop (rollback) and close only move a length or free the row;
  - stale positions (past a crop, or left by the slot's previous session) stay in place
    and stay invisible: the query at position p sees keys j <= p only, and every j <= p
    has been written by the current session before that query runs.
Column max_len - 1 of every slot is reserved *scratch*: padding tokens (idle rows of a
dense batch, right-padding of ragged catch-ups) write their keys/values there, and no
real query can see it (real positions stop at max_len - 2). So a session holds at most
max_len - 1 positions.

The budget is in tokens: slots = kv_budget_tokens // max_len (at least one), so memory is
  2 * layers * slots * kv_heads * max_len * head_dim * bytes_per_element.
"""

from __future__ import annotations

import heapq

import torch

from backoff_core.errors import KVCapacityError


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n (buckets ascending); n itself when it passes them all."""
    for b in buckets:
        if b >= n:
            return b
    return n


def powers_of_two(low: int, high: int, factor: int = 2) -> tuple[int, ...]:
    """low, factor*low, ... below high, then high itself: [64, 128, ..., max_len]."""
    out, b = [], low
    while b < high:
        out.append(b)
        b *= factor
    return (*out, high)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class StaticKV:
    """The K/V tensors of every layer plus the slot allocator (lowest free slot first, so
    live sessions stay packed at the bottom rows and a dense batch view stays small)."""

    def __init__(self, model, kv_budget_tokens: int, max_len: int, name: str = "model") -> None:
        if max_len < 2:
            raise ValueError(f"{name}: max_len must be >= 2 (one column is scratch), got {max_len}")
        if kv_budget_tokens < 1:
            raise ValueError(f"{name}: kv_budget_tokens must be >= 1, got {kv_budget_tokens}")
        config = model.config
        attn = model.model.layers[0].self_attn
        param = next(model.parameters())
        self.name = name
        self.budget = kv_budget_tokens
        self.max_len = max_len
        self.scratch = max_len - 1  # the reserved column
        self.slots = max(1, kv_budget_tokens // max_len)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        shape = (self.slots, self.kv_heads, max_len, self.head_dim)
        layers = len(model.model.layers)
        # zeros, not empty: masked keys get weight 0, and 0 * NaN garbage would still be NaN
        self.storage = torch.zeros((layers, 2, *shape), dtype=param.dtype, device=param.device)
        self.keys = list(self.storage[:, 0].unbind())  # each [slots, kv_heads, max_len, head_dim], contiguous
        self.values = list(self.storage[:, 1].unbind())
        self._free = list(range(self.slots))  # a heap: lowest slot first

    @property
    def capacity(self) -> int:
        """Positions one session can hold."""
        return self.max_len - 1

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def free_slot_ids(self) -> list[int]:
        """The slots no session holds, lowest first."""
        return sorted(self._free)

    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def take(self) -> int:
        if not self._free:
            raise KVCapacityError(
                f"{self.name}: no free KV slot: all {self.slots} slots of {self.max_len} positions are "
                f"in use (kv_budget_tokens={self.budget}); retry when a session ends"
            )
        return heapq.heappop(self._free)

    def give_back(self, slot: int) -> None:
        heapq.heappush(self._free, slot)  # no clearing: the mask hides what the slot held

    def read(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """Positions start..stop of a slot, every layer: [layers, 2, kv_heads, stop - start, head_dim], a copy."""
        return self.storage[:, :, slot, :, start:stop].clone(memory_format=torch.contiguous_format)

    def write(self, slot: int, kv: torch.Tensor) -> None:
        """kv [layers, 2, kv_heads, n, head_dim] into positions 0..n of a slot (a prefix cache's blocks)."""
        self.storage[:, :, slot, :, : kv.shape[3]] = kv

    def check_room(self, request_id: str, length: int, new: int) -> None:
        if length + new > self.capacity:
            raise KVCapacityError(
                f"{self.name}: session {request_id!r} would hold {length + new} positions, over the limit of "
                f"{self.capacity} (max_len={self.max_len}, one column reserved); start a new request"
            )
