"""The cyclic garbage collector in a long-running step loop: the startup heap frozen out of
its reach, and its pauses recorded.

CPython's collector stops the process for a collection: it holds the GIL while it walks
every object of the generations it collects, so each stream's next token waits for it. A
full collection (generation 2) walks every tracked object: ~0.5 M in a serving replica once
torch, transformers, Ray Serve, pydantic and FastAPI are loaded, 0.4-1.5 s on a loaded
2-core machine (docs/step-overhead.md). It runs whenever the objects that survived into the
oldest generation since the last one pass a quarter of it.

The objects made at startup (modules, the models' modules and parameters, the tokenizer,
the captured graphs' bookkeeping) never become garbage. `freeze_startup_heap`, called once
after load and warm-up, moves them to the permanent generation, which collections skip: a
collection then walks only what was made since. Garbage is collected first, since a frozen
cycle could never be freed. Objects made later are tracked and collected as before: this
is not gc.disable(). Ray Serve (2.60) does exactly this in every replica once its __init__
returns (RAY_SERVE_FREEZE_GC_ON_STARTUP, on by default), and vLLM after its warm-up
(vllm/utils/gc_utils.py, freeze_gc_heap); benchmarks/gc_pauses.py calls it here to measure the
step loop over both heaps.

`GCWatch` records every collection's generation and duration (gc.callbacks): the replicas'
info() reports it, with how many objects are frozen (installed in their __init__, so Ray
Serve's collection at the freeze is its first full one).
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass

GENERATIONS = 3


def freeze_startup_heap() -> int:
    """Collect every generation, then freeze what is left (gc.freeze): call once, after load
    and warm-up and before serving. Returns how many objects the permanent generation holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass(frozen=True)
class GCStats:
    """The collections since a GCWatch was installed, per generation (index 0, 1, 2)."""

    collections: tuple[int, ...]
    seconds: tuple[float, ...]  # their pauses summed
    longest_s: tuple[float, ...]  # the longest pause
    frozen: int  # objects in the permanent generation now (0: the heap is not frozen)

    @property
    def total_s(self) -> float:
        return sum(self.seconds)


class GCWatch:
    """Times each collection of this process through gc.callbacks. The callback runs inside
    the collection (the GIL held, collection off), so it only stores numbers; `stats()` reads
    them. One per process is enough (`GCWatch.shared()`); a watch stops at `close()`."""

    _shared: GCWatch | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._collections = [0] * GENERATIONS
        self._seconds = [0.0] * GENERATIONS
        self._longest = [0.0] * GENERATIONS
        self._started = 0.0
        gc.callbacks.append(self._callback)

    @classmethod
    def shared(cls) -> GCWatch:
        """The process's watch, installed by the first call."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        g = info["generation"]
        self._collections[g] += 1
        self._seconds[g] += pause
        self._longest[g] = max(self._longest[g], pause)

    def stats(self) -> GCStats:
        return GCStats(tuple(self._collections), tuple(self._seconds), tuple(self._longest), gc.get_freeze_count())

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
