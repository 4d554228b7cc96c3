"""KV events of a block pool (engine/kv_events.py): numbered, coalesced until read, a snapshot
when the reader is new, of another epoch or behind the buffer, a `cleared` on reset; and a
reader that applies whatever it is answered (the router's KVIndex) holds exactly the pool's
prefix cache after any sequence of allocations, caching, evictions and resets."""
from __future__ import annotations

import random

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import CLEARED, EVICTED, STORED, KVEventLog
from router.kv_index import KVIndex


def _pool(num_pages: int = 4, capacity: int = 1 << 16) -> tuple[BlockPool, KVEventLog]:
    pool = BlockPool(num_pages)
    pool.events = log = KVEventLog(16, pool.cached_hashes, capacity)
    return pool, log


def test_events_are_numbered_and_coalesced_until_read():
    pool, log = _pool()
    first = log.since("", 0)
    assert first.snapshot == () and first.reason == "new" and first.seq == 0 and first.page_size == 16
    a, b = pool.allocate(2)
    pool.cache_page(a, 11, [1])
    pool.cache_page(b, 12, [2])  # the same kind, unread: one event
    batch = log.since(log.epoch, 0)
    assert [(e.seq, e.kind, e.block_hashes) for e in batch.events] == [(1, STORED, (11, 12))]
    assert batch.seq == 1 and batch.snapshot is None
    (c,) = pool.allocate(1)
    pool.cache_page(c, 13, [3])  # event 1 was read: a new one
    assert [(e.seq, e.block_hashes) for e in log.since(log.epoch, 0).events] == [(1, (11, 12)), (2, (13,))]
    assert [e.seq for e in log.since(log.epoch, 1).events] == [2]
    assert log.since(log.epoch, 2).events == ()


def test_eviction_and_reset_are_events():
    pool, log = _pool(num_pages=2)
    pages = pool.allocate(2)
    pool.cache_pages(pages, [21, 22], [5, 6], 0, 2, 1)
    pool.free(reversed(pages))
    seq = log.since(log.epoch, 0).seq
    pool.allocate(1)  # hands out the least recently freed cached page: 22 (tails are freed first)
    assert [(e.kind, e.block_hashes) for e in log.since(log.epoch, seq).events] == [(EVICTED, (22,))]
    seq = log.seq
    pool.reset_prefix_cache()
    assert [(e.kind, e.block_hashes) for e in log.since(log.epoch, seq).events] == [(CLEARED, ())]
    assert log.since("", 0).snapshot == ()


def test_a_reader_of_another_epoch_or_behind_the_buffer_gets_a_snapshot():
    pool, log = _pool(num_pages=64, capacity=8)
    pages = pool.allocate(12)
    for i, page in enumerate(pages):
        pool.cache_page(page, 100 + i, [i])
        log.since(log.epoch, log.seq)  # read after each: no coalescing, one event per page
    other = KVEventLog(16, pool.cached_hashes)
    assert other.epoch != log.epoch  # every log (every engine instance) has its own
    stale = log.since(other.epoch, 3)
    assert stale.reason == "epoch" and sorted(stale.snapshot) == list(range(100, 112)) and stale.seq == 12
    behind = log.since(log.epoch, 1)  # events 2.. were dropped from the 8-hash buffer
    assert behind.reason == "overflow" and sorted(behind.snapshot) == list(range(100, 112))
    recent = log.since(log.epoch, 10)
    assert [e.block_hashes for e in recent.events] == [(110,), (111,)]
    assert log.since(log.epoch, 99).reason == "overflow"  # a seq this log never had


def test_an_unread_burst_is_bounded():
    pool, log = _pool(num_pages=4096, capacity=64)
    log.since("", 0)
    pages = pool.allocate(4000)
    pool.cache_pages(pages, list(range(1, 4001)), list(range(4000)), 0, 4000, 1)
    assert sum(len(h) for _, _, h in log._events) <= 64  # dropped, never piled up
    assert sorted(log.since(log.epoch, 0).snapshot) == list(range(1, 4001))
    assert log.since(log.epoch, log.seq).events == ()  # a reader that is up to date needs nothing


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        KVEventLog(16, list, capacity=0)


class _Seq:
    """A paged sequence (engine.kv_cache_manager.PagedSequence) of given tokens."""

    def __init__(self, tokens):
        self.all_token_ids, self.pages, self.block_hashes = list(tokens), [], []
        self.num_computed_tokens = self.num_cached_pages_registered = 0


@pytest.mark.parametrize("seed", range(4))
def test_a_reader_of_the_events_holds_exactly_the_prefix_cache(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(num_pages=24, page_size=4)
    pool = kv.pool
    pool.events = log = KVEventLog(4, pool.cached_hashes, capacity=rng.choice([6, 40, 1 << 16]))
    index = KVIndex(4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    live: list[_Seq] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.45:  # a request: cached prefix, pages for the rest, computed and registered
            seq = _Seq(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 10))])
            hits = kv.find_cached_prefix(seq)
            seq.num_computed_tokens = len(hits) * 4
            if kv.allocate(seq, len(seq.all_token_ids) - seq.num_computed_tokens, hits):
                seq.num_computed_tokens = len(seq.all_token_ids)
                kv.cache_full_pages(seq)
                live.append(seq)
        elif op < 0.85 and live:
            kv.free(live.pop(rng.randrange(len(live))))
        elif op < 0.88:
            pool.reset_prefix_cache()
        if rng.random() < 0.3:  # the router pulls now and then
            index.apply("w", log.since(*index.cursor("w")))
            assert index.blocks("w") == set(pool._by_hash) and index.exact("w")
    index.apply("w", log.since(*index.cursor("w")))
    assert index.blocks("w") == set(pool._by_hash)
