"""engine/gc_heap.py: the startup heap frozen out of the collector's reach (garbage freed
first), and every collection's generation and pause recorded."""

from __future__ import annotations

import gc
import weakref

import pytest

from backoff_core.engine.gc_heap import GCWatch, freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


@pytest.fixture
def unfrozen():
    """The test process's heap as it was, whatever the test froze."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_collects_garbage_first_then_takes_the_rest_out_of_collections(unfrozen):
    garbage = weakref.ref(_cycle())  # unreachable already: only a collection frees a cycle
    kept = _cycle()
    assert garbage() is not None and gc.is_tracked(kept)
    tracked = len(gc.get_objects())
    frozen = freeze_startup_heap()
    assert garbage() is None  # freed, not made permanent
    # what was frozen, less what has been freed since (another thread's objects may go)
    assert frozen >= gc.get_freeze_count() > 0.99 * frozen
    # a collection's lists no longer hold the heap: what it walks shrank by what was frozen
    after = gc.get_objects()
    assert all(o is not kept for o in after)
    assert len(after) < tracked - frozen // 2
    # objects made later are collected as before (this is not gc.disable())
    later = weakref.ref(_cycle())
    gc.collect()
    assert later() is None
    # still alive, merely skipped
    assert kept.other.other is kept
    gc.unfreeze()
    assert gc.get_freeze_count() == 0 and any(o is kept for o in gc.get_objects())


def test_the_watch_records_each_collection_by_generation():
    watch = GCWatch()
    try:
        gc.collect(0)
        gc.collect(0)
        gc.collect(2)
        s = watch.stats()
        assert s.collections[0] >= 2 and s.collections[2] >= 1
        assert s.seconds[2] > 0 and s.longest_s[2] <= s.seconds[2]
        assert s.total_s == pytest.approx(sum(s.seconds))
        assert s.frozen == gc.get_freeze_count()
    finally:
        watch.close()
    assert watch._callback not in gc.callbacks
    gc.collect(0)
    assert watch.stats().collections == s.collections  # closed: records nothing more


def test_the_shared_watch_is_installed_once():
    first = GCWatch.shared()
    assert GCWatch.shared() is first
    assert gc.callbacks.count(first._callback) == 1
