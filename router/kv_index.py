"""The cluster-wide KV index: which workers hold each block hash in their prefix cache, kept
exact from the workers' KV events (engine/kv_events.py), and saying so when it is not.

`KVIndex` is the data: block hash -> {worker id: tier} (tier "device": the worker's own KV
cache, the only tier so far), and per worker its epoch, last seq and state. `KVIndexSync` feeds
it: the dispatcher's load refresh calls `pull` for each worker, which keeps at most one
`kv_events(epoch, seq)` call pending per worker and applies the answer when it comes.

A worker's index state (the policy routes by the index only while it is EXACT):

    UNKNOWN --snapshot--> EXACT --events, each seq the last + 1--> EXACT
                            |  \\--a gap in the seqs (resync: the next pull asks a snapshot)
                            |  \\--a pull failed, the worker unresponsive, its page size differs
                            v      from the router's hash_page_size
                         DEGRADED --snapshot, or the next events in order--> EXACT
    any --the worker lost (its cache is gone) or removed--> UNKNOWN (its entries dropped)

EXACT means: equal to the worker's prefix cache as of its last answer (one load refresh old at
most). Placement also counts what this router has just placed on a worker (`expect`) until the
worker's events confirm it (stored) or contradict it (evicted, cleared), for `expect_s` at most:
without that, the second turn of a conversation, sent before the next refresh, would not find
the first turn's pages. A snapshot replaces the worker's entries; its reason, counted for the metrics: "first"
(never synced), "restart" (a new epoch: the worker's engine was replaced), "gap" or "lost"
(the router asked for it), "overflow" (the worker's buffer had dropped the events asked for).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.kv_events import CLEARED, EVICTED, STORED, KVEventBatch

TIER_DEVICE = "device"  # the worker's own KV cache (tiers below it come with the KV store)
UNKNOWN, EXACT, DEGRADED = "unknown", "exact", "degraded"
SNAPSHOT_REASONS = ("first", "restart", "gap", "lost", "overflow")

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerIndex:
    worker_id: str
    state: str = UNKNOWN
    reason: str = "no events yet"   # why the state is not EXACT ("" when it is)
    epoch: str = ""                 # of the worker's event log, as last applied
    seq: int = 0                    # the last event applied
    page_size: int = 0
    blocks: set[int] = field(default_factory=set)
    resync: str = ""                # the next pull asks for a snapshot, for this reason
    events: int = 0                 # events applied
    fallbacks: int = 0              # placements that used the router's approximate LRU instead
    generation: int = 0             # one more at each drop: an answer asked for before it is stale
    expected: dict[int, float] = field(default_factory=dict)  # placed here, not yet confirmed: hash -> when


class KVIndex:
    def __init__(self, page_size: int, expect_s: float = 5.0) -> None:
        """`page_size`: the router's hash_page_size; a worker whose pages differ cannot be matched.
        `expect_s`: how long a placement's pages count as cached before the worker confirms them."""
        self.page_size = page_size
        self.expect_s = expect_s
        self.workers: dict[str, WorkerIndex] = {}
        self._where: dict[int, dict[str, str]] = {}
        self.snapshots = dict.fromkeys(SNAPSHOT_REASONS, 0)

    # ---- reading --------------------------------------------------------------------------
    def holders(self, block_hash: int) -> dict[str, str]:
        """{worker id: tier} of the workers that hold `block_hash`."""
        return dict(self._where.get(block_hash, {}))

    def exact(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        return w is not None and w.state == EXACT

    def all_exact(self, worker_ids: Iterable[str]) -> bool:
        return all(self.exact(wid) for wid in worker_ids)

    def blocks(self, worker_id: str) -> set[int]:
        w = self.workers.get(worker_id)
        return set(w.blocks) if w is not None else set()

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes cached anywhere."""
        return len(self._where)

    def matched_pages(self, worker_id: str, hashes: Sequence[int]) -> int:
        """How many leading pages of a prompt (its block hashes) the worker holds, or will hold
        once what this router just placed there is computed (`expect`)."""
        w = self.workers.get(worker_id)
        if w is None:
            return 0
        blocks, expected, n = w.blocks, w.expected, 0
        recent = time.monotonic() - self.expect_s
        for h in hashes:
            if h not in blocks and expected.get(h, recent) <= recent:
                break
            n += 1
        return n

    def expect(self, worker_id: str, hashes: Sequence[int]) -> None:
        """This router placed a prompt of these block hashes on the worker: count them as its own
        until its events say otherwise (the module docstring)."""
        w = self._worker(worker_id)
        now = time.monotonic()
        if len(w.expected) > 4 * len(hashes) + 1024:  # prune what was never confirmed
            w.expected = {h: t for h, t in w.expected.items() if t > now - self.expect_s}
        for h in hashes:
            if h not in w.blocks:
                w.expected[h] = now

    def cursor(self, worker_id: str) -> tuple[str, int]:
        """What to ask the worker next: (epoch, seq) of the last event applied, or ("", 0) for a
        snapshot."""
        w = self._worker(worker_id)
        return ("", 0) if w.resync or not w.epoch else (w.epoch, w.seq)

    # ---- writing --------------------------------------------------------------------------
    def apply(self, worker_id: str, batch: KVEventBatch) -> None:
        """Apply a worker's answer to `kv_events(*self.cursor(worker_id))`."""
        w = self._worker(worker_id)
        w.page_size = batch.page_size
        if batch.snapshot is not None:
            reason = ("first" if not w.epoch else "restart" if batch.epoch != w.epoch
                      else w.resync or "overflow")
            self.snapshots[reason] += 1
            log.info("KV index: snapshot of %s (%s): %d blocks at seq %d", worker_id, reason,
                     len(batch.snapshot), batch.seq)
            self._replace(w, set(batch.snapshot))
            w.epoch, w.seq, w.resync = batch.epoch, batch.seq, ""
        else:
            if batch.epoch != w.epoch:
                self._gap(w, f"events of epoch {batch.epoch} while the index has {w.epoch or 'none'}")
                return
            for ev in batch.events:
                if ev.seq != w.seq + 1:
                    self._gap(w, f"event {ev.seq} after {w.seq}")
                    return
                self._apply_event(w, ev.kind, ev.block_hashes)
                w.seq = ev.seq
                w.events += 1
        if batch.page_size != self.page_size:
            self._degrade(w, f"page size {batch.page_size} differs from the router's hash_page_size "
                             f"{self.page_size}: its block hashes cannot match the prompts'")
        else:
            w.state, w.reason = EXACT, ""

    def fallback(self, worker_id: str) -> None:
        """A placement judged the worker by the router's approximate LRU: its index is not exact."""
        self._worker(worker_id).fallbacks += 1

    def degrade(self, worker_id: str, reason: str) -> None:
        """The index may miss the worker's latest changes (a pull failed, it is unresponsive):
        its entries stay, unused for placement, until its next answer."""
        self._degrade(self._worker(worker_id), reason)

    def drop(self, worker_id: str, reason: str) -> None:
        """The worker's cache is gone (its process was lost): drop its entries; the next pull
        asks for a snapshot."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        self._replace(w, set())
        w.expected.clear()
        w.state, w.reason, w.resync = UNKNOWN, reason[:300], "lost"
        w.generation += 1

    def remove(self, worker_id: str) -> None:
        """Forget a worker removed from the router."""
        w = self.workers.pop(worker_id, None)
        if w is not None:
            self._replace(w, set())

    # ---- internals ------------------------------------------------------------------------
    def _worker(self, worker_id: str) -> WorkerIndex:
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerIndex(worker_id)
        return w

    def _degrade(self, w: WorkerIndex, reason: str) -> None:
        if w.state != DEGRADED or w.reason != reason[:300]:
            log.warning("KV index of worker %s degraded: %s", w.worker_id, reason)
        w.state, w.reason = DEGRADED, reason[:300]

    def _gap(self, w: WorkerIndex, what: str) -> None:
        self._degrade(w, f"gap in its KV events ({what}); a snapshot is asked")
        w.resync = "gap"

    def _apply_event(self, w: WorkerIndex, kind: str, hashes: Sequence[int]) -> None:
        if kind == STORED:
            self._add(w, hashes)
        elif kind == EVICTED:
            self._discard(w, hashes)
        elif kind == CLEARED:
            self._replace(w, set())
            w.expected.clear()
        else:
            raise ValueError(f"KV event kind must be one of {[STORED, EVICTED, CLEARED]}, got {kind!r}")

    def _add(self, w: WorkerIndex, hashes: Iterable[int]) -> None:
        wid, where, expected = w.worker_id, self._where, w.expected
        for h in hashes:
            w.blocks.add(h)
            if expected:
                expected.pop(h, None)  # confirmed
            holders = where.get(h)
            if holders is None:
                where[h] = {wid: TIER_DEVICE}
            else:
                holders[wid] = TIER_DEVICE

    def _discard(self, w: WorkerIndex, hashes: Iterable[int]) -> None:
        wid, where, expected = w.worker_id, self._where, w.expected
        for h in hashes:
            w.blocks.discard(h)
            if expected:
                expected.pop(h, None)  # contradicted
            holders = where.get(h)
            if holders is not None:
                holders.pop(wid, None)
                if not holders:
                    del where[h]

    def _replace(self, w: WorkerIndex, blocks: set[int]) -> None:
        self._discard(w, w.blocks - blocks)
        self._add(w, blocks - w.blocks)


class KVIndexSync:
    """Pulls every worker's KV events into a KVIndex: one call pending per worker at most (a
    worker mid-step answers after the step), each answer applied the moment it comes."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self._calls: dict[str, asyncio.Future] = {}

    def pull(self, worker_id: str, handle: Any) -> asyncio.Future:
        """Ask the worker for its events since the index's cursor (unless a call is pending);
        returns the call, done once its answer is applied."""
        call = self._calls.get(worker_id)
        if call is not None:
            return call
        asked = (self.index.cursor(worker_id), self.index.workers[worker_id].generation)
        call = self._calls[worker_id] = asyncio.ensure_future(_kv_events(handle, *asked[0]))
        call.add_done_callback(lambda c: self._answer(worker_id, asked, c))
        return call

    def _answer(self, worker_id: str, asked: tuple, call: asyncio.Future) -> None:
        if self._calls.get(worker_id) is call:
            del self._calls[worker_id]
        w = self.index.workers.get(worker_id)
        if call.cancelled() or w is None:
            return
        if (self.index.cursor(worker_id), w.generation) != asked:  # dropped while the call was pending: stale
            return
        exc = call.exception()
        if exc is not None:
            self.index.degrade(worker_id, f"kv_events failed: {type(exc).__name__}: {str(exc)[:200]}")
        else:
            self.index.apply(worker_id, call.result())

    def forget(self, worker_id: str) -> None:
        call = self._calls.pop(worker_id, None)
        if call is not None:
            call.cancel()
        self.index.remove(worker_id)

    async def close(self) -> None:
        calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


async def _kv_events(handle: Any, epoch: str, seq: int) -> KVEventBatch:
    return await handle.kv_events(epoch, seq)  # (a handle without the call fails here, not in pull)
