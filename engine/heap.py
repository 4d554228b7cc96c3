"""Python's cyclic garbage collector in a long-lived serving process.

A worker or router process holds some 340,000-380,000 GC-tracked objects once torch, Ray, gRPC,
NIXL and the model are loaded, and a full (generation 2) collection walks all of them: 155-172 ms
on a 2-core EPYC, during which the process runs nothing else (for the router: no stream gets a
chunk). CPython runs one whenever the objects that survived younger collections reach a quarter
of the old generation, which a busy process reaches now and then: in one disaggregated serving
run at 3.5 req/s (96 requests) the router paused once, for 341 ms.

`freeze_startup_heap()` collects once and moves every object alive at that point to the
permanent generation (`gc.freeze`), which later collections skip: the startup objects live as
long as the process does anyway. Full collections then walk only what serving allocated.
`GcPauses` counts and times every collection (gc.callbacks), so the pauses that remain show
in /metrics.
"""
from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


_frozen = 0  # objects the last freeze exempted (gc.get_freeze_count() walks them all: ~30 ms)


def freeze_startup_heap() -> int:
    """Collect, then exempt every live object from later collections; returns how many."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()
    return _frozen


def unfreeze_heap() -> None:
    """Return the frozen objects to the collector (`gc.unfreeze`)."""
    global _frozen
    gc.unfreeze()
    _frozen = 0


@contextmanager
def heap_frozen() -> Iterator[None]:
    """`freeze_startup_heap()` for a while (a benchmark client's run); unfreezes on exit unless
    the process had frozen its heap before."""
    before = _frozen or gc.get_freeze_count()  # the count walks what is frozen: ours is known
    freeze_startup_heap()
    try:
        yield
    finally:
        if not before:
            unfreeze_heap()


@dataclass(frozen=True, slots=True)
class GcPauseStats:
    collections: tuple[int, int, int]  # per generation
    seconds: tuple[float, float, float]  # total pause per generation
    max_seconds: float
    frozen_objects: int


class GcPauses:
    """Counts and times this process's garbage collections, per generation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = [0, 0, 0]
        self._seconds = [0.0, 0.0, 0.0]
        self._max = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        gen = info.get("generation", 2)
        with self._lock:
            self._count[gen] += 1
            self._seconds[gen] += pause
            self._max = max(self._max, pause)

    def stats(self) -> GcPauseStats:
        with self._lock:
            return GcPauseStats(tuple(self._count), tuple(self._seconds), self._max, _frozen)


_pauses: GcPauses | None = None
_install_lock = threading.Lock()


def gc_pauses() -> GcPauses:
    """This process's recorder, installed on first use."""
    global _pauses
    with _install_lock:
        if _pauses is None:
            _pauses = GcPauses()
            gc.callbacks.append(_pauses._callback)
        return _pauses
