"""engine.heap: the startup heap is frozen out of later collections, and collections are counted
and timed per generation."""
from __future__ import annotations

import gc

from engine.heap import freeze_startup_heap, gc_pauses, heap_frozen, unfreeze_heap


def _unfreeze_after(fn):
    def wrapper(*a, **kw):
        assert gc.get_freeze_count() == 0, "the test process's heap is frozen already"
        try:
            return fn(*a, **kw)
        finally:
            unfreeze_heap()
    wrapper.__name__ = fn.__name__
    return wrapper


@_unfreeze_after
def test_frozen_objects_are_skipped_by_later_collections():
    class Node:
        pass

    keep = [Node() for _ in range(20_000)]  # tracked objects alive at "startup"
    frozen = freeze_startup_heap()
    assert frozen >= 20_000
    # a later full collection walks only what was allocated since: none of `keep`
    tracked = gc.get_objects()
    assert len(tracked) < frozen / 10
    assert not any(o is keep[0] for o in tracked)
    # cyclic garbage made after the freeze is still collected
    a, b = Node(), Node()
    a.other, b.other = b, a
    del a, b
    assert gc.collect() >= 2


def test_heap_frozen_unfreezes_on_exit_unless_frozen_before():
    assert gc.get_freeze_count() == 0
    with heap_frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_collections_are_counted_and_timed_per_generation():
    rec = gc_pauses()
    assert gc_pauses() is rec  # one recorder per process
    before = rec.stats()
    gc.collect(0)
    gc.collect(2)
    gc.collect(2)
    after = rec.stats()
    assert after.collections[0] - before.collections[0] >= 1
    assert after.collections[2] - before.collections[2] >= 2
    assert after.seconds[2] > before.seconds[2]
    assert after.max_seconds >= (after.seconds[2] - before.seconds[2]) / (after.collections[2] - before.collections[2])
