"""KV events: what one engine's prefix cache gained and lost, numbered, so a router can keep an
exact copy of which block hashes the engine holds (router/kv_index.py).

    BlockPool change            event               the index does
    a full page registered  ->  stored(hashes)  ->  add the hashes to the worker's set
    a cached page reused    ->  evicted(hashes) ->  remove them
    reset_prefix_cache      ->  cleared()       ->  empty the worker's set

Every event has the next sequence number of its log (1, 2, ...). A reader asks `since(epoch,
seq)` with the last (epoch, seq) it applied and gets every event after `seq`, or, when it cannot
be answered exactly, a **snapshot**: every block hash cached now, with the current seq, from
which events continue. A snapshot answers a reader that has nothing yet (epoch ""), one that
knew another epoch (the engine was replaced: every engine instance has a new one), and one
whose events the bounded buffer has already dropped (overflow).

Cost: the log exists only once someone asks (EngineCore.kv_events); until then the block pool
pays one `is None` test per change. Events written since the last read are coalesced (a burst
of stored pages is one event); once read, an event never changes.

No torch here: the batch crosses into the router's process.
"""
from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

STORED, EVICTED, CLEARED = "stored", "evicted", "cleared"
KINDS = (STORED, EVICTED, CLEARED)
DEFAULT_CAPACITY = 1 << 16  # block hashes the buffer keeps; older events are answered by a snapshot


@dataclass(slots=True, frozen=True)
class KVEvent:
    seq: int
    kind: str                      # STORED, EVICTED or CLEARED (no hashes: every one is gone)
    block_hashes: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class KVEventBatch:
    """The answer to `since(epoch, seq)`: events after seq, or a snapshot (then `events` is empty
    and `snapshot` holds every block hash cached at `seq`)."""
    epoch: str
    page_size: int                 # tokens per page: the block hashes are of pages this long
    seq: int                       # the log's last seq: the reader's next `since`
    events: tuple[KVEvent, ...] = ()
    snapshot: tuple[int, ...] | None = None
    reason: str = ""               # why a snapshot: "new" (epoch ""), "epoch" (another engine), "overflow"


class KVEventLog:
    """The event log of one engine's block pool. Call everything from the engine's thread."""

    def __init__(self, page_size: int, cached_hashes: Callable[[], Iterable[int]],
                 capacity: int = DEFAULT_CAPACITY) -> None:
        """`cached_hashes`: every block hash the pool holds now (what a snapshot carries)."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.epoch = secrets.token_hex(8)
        self.page_size = page_size
        self.capacity = capacity
        self.seq = 0
        self._cached_hashes = cached_hashes
        self._events: deque[tuple[int, str, list[int]]] = deque()  # (seq, kind, hashes), oldest first
        self._size = 0        # hashes held in _events
        self._read = 0        # events up to this seq were read: they never change again
        self._dropped = 0     # the last seq dropped from the buffer (a reader before it needs a snapshot)
        self._burst = max(1, capacity // 8)  # hashes one unread event may coalesce (then a new one starts)

    # ---- what the block pool calls --------------------------------------------------------
    def stored(self, block_hashes: Iterable[int]) -> None:
        self._record(STORED, block_hashes)

    def evicted(self, *block_hashes: int) -> None:
        self._record(EVICTED, block_hashes)

    def cleared(self) -> None:
        self._record(CLEARED, ())

    # ---- what a reader calls --------------------------------------------------------------
    def since(self, epoch: str, seq: int) -> KVEventBatch:
        """The events after `seq` of `epoch`, or a snapshot (the module docstring)."""
        self._read = self.seq
        reason = ""
        if epoch != self.epoch:
            reason = "new" if not epoch else "epoch"
        elif not self._dropped <= seq <= self.seq:
            reason = "overflow"
        if reason:
            return KVEventBatch(self.epoch, self.page_size, self.seq, snapshot=tuple(self._cached_hashes()),
                                reason=reason)
        events = tuple(KVEvent(s, kind, tuple(hashes)) for s, kind, hashes in self._events if s > seq)
        return KVEventBatch(self.epoch, self.page_size, self.seq, events)

    def __len__(self) -> int:
        return len(self._events)

    def _record(self, kind: str, block_hashes: Iterable[int]) -> None:
        last = self._events[-1] if self._events else None
        if (last is not None and last[0] > self._read and last[1] == kind and kind != CLEARED
                and len(last[2]) < self._burst):
            before = len(last[2])
            last[2].extend(block_hashes)  # not read yet: one event for the burst
            self._size += len(last[2]) - before
        else:
            self.seq += 1
            hashes = list(block_hashes)
            self._events.append((self.seq, kind, hashes))
            self._size += len(hashes) + 1
        while self._size > self.capacity:  # (a burst larger than the buffer goes too: its readers get snapshots)
            seq, _, hashes = self._events.popleft()
            self._size -= len(hashes) + 1
            self._dropped = seq
