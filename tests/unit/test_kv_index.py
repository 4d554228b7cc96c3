"""The router's KV index (router/kv_index.py): applies snapshots and events, knows which worker
holds which block hash, turns degraded on a gap (and asks a snapshot), takes a restarted
worker's snapshot in place of its old entries, drops a lost worker's, ignores an answer asked
before a drop; and prefix-aware placement routes by it while exact, by the LRU guess (counted)
while not."""
from __future__ import annotations

import asyncio

from engine.kv_events import CLEARED, EVICTED, STORED, KVEvent, KVEventBatch
from router.kv_index import DEGRADED, EXACT, UNKNOWN, KVIndex, KVIndexSync
from router.policy import WorkerView, make_policy


def snap(epoch, seq, hashes, page_size=16):
    return KVEventBatch(epoch, page_size, seq, snapshot=tuple(hashes), reason="new")


def events(epoch, *evs, page_size=16):
    return KVEventBatch(epoch, page_size, evs[-1][0] if evs else 0, tuple(KVEvent(s, k, tuple(h)) for s, k, h in evs))


def test_snapshot_then_events_keep_an_exact_index_of_every_worker():
    index = KVIndex(16)
    assert index.cursor("a") == ("", 0) and index.workers["a"].state == UNKNOWN
    index.apply("a", snap("ea", 3, [1, 2, 3]))
    index.apply("b", snap("eb", 0, []))
    assert index.cursor("a") == ("ea", 3) and index.exact("a") and index.snapshots["first"] == 2
    index.apply("a", events("ea", (4, STORED, [4, 5]), (5, EVICTED, [1])))
    index.apply("b", events("eb", (1, STORED, [2, 9])))
    assert index.blocks("a") == {2, 3, 4, 5} and index.blocks("b") == {2, 9}
    assert index.holders(2) == {"a": "device", "b": "device"} and index.holders(1) == {}
    assert index.num_blocks == 5 and index.workers["a"].events == 2
    assert index.matched_pages("a", [2, 3, 7, 4]) == 2 and index.matched_pages("b", [3]) == 0
    index.apply("a", events("ea", (6, CLEARED, [])))
    assert index.blocks("a") == set() and index.holders(2) == {"b": "device"}
    index.remove("b")
    assert index.num_blocks == 0 and "b" not in index.workers


def test_a_gap_degrades_the_worker_until_a_snapshot():
    index = KVIndex(16)
    index.apply("a", snap("e", 1, [1]))
    index.apply("a", events("e", (3, STORED, [7])))  # event 2 never came
    w = index.workers["a"]
    assert w.state == DEGRADED and "gap" in w.reason and 7 not in w.blocks
    assert index.cursor("a") == ("", 0)  # the next pull asks for a snapshot
    assert not index.all_exact(["a"])
    index.apply("a", snap("e", 3, [1, 7]))
    assert index.exact("a") and index.blocks("a") == {1, 7} and index.snapshots["gap"] == 1
    index.apply("a", events("other", (4, STORED, [8])))  # another epoch's events: never applied
    assert not index.exact("a") and 8 not in index.blocks("a")


def test_a_restarted_worker_replaces_its_entries():
    index = KVIndex(16)
    index.apply("a", snap("old", 5, [1, 2, 3]))
    index.apply("a", snap("new", 0, [9]))  # what the worker answers from a new engine: its new epoch
    assert index.blocks("a") == {9} and index.holders(1) == {} and index.snapshots["restart"] == 1
    index.drop("a", "lost: the process died")
    w = index.workers["a"]
    assert w.state == UNKNOWN and w.blocks == set() and index.num_blocks == 0 and index.cursor("a") == ("", 0)
    index.apply("a", snap("newer", 0, [4]))
    assert index.exact("a") and index.snapshots["restart"] == 2


def test_a_worker_of_another_page_size_is_degraded():
    index = KVIndex(16)
    index.apply("a", snap("e", 0, [1], page_size=32))
    assert index.workers["a"].state == DEGRADED and "page size 32" in index.workers["a"].reason
    assert index.blocks("a") == {1}  # kept: exact data, only unusable for matching the router's hashes


class FakeHandle:
    def __init__(self):
        self.asked, self.answer = [], asyncio.Event()
        self.batch: KVEventBatch | None = None

    async def kv_events(self, epoch, since):
        self.asked.append((epoch, since))
        await self.answer.wait()
        if self.batch is None:
            raise ConnectionError("worker gone")
        return self.batch


def test_sync_keeps_one_call_per_worker_and_drops_stale_answers():
    async def main():
        index = KVIndex(16)
        sync = KVIndexSync(index)
        h = FakeHandle()
        first = sync.pull("a", h)
        assert sync.pull("a", h) is first  # one call pending at most
        h.batch = snap("e", 2, [1, 2])
        h.answer.set()
        await first
        await asyncio.sleep(0)
        assert index.exact("a") and h.asked == [("", 0)]
        h.answer.clear()
        pending = sync.pull("a", h)
        await asyncio.sleep(0)
        index.drop("a", "lost")  # while the call is pending
        h.batch = events("e", (3, STORED, [5]))
        h.answer.set()
        await pending
        await asyncio.sleep(0)
        assert index.blocks("a") == set() and index.workers["a"].state == UNKNOWN  # the stale answer was ignored
        h.batch = None
        failed = sync.pull("a", h)
        await asyncio.gather(failed, return_exceptions=True)
        await asyncio.sleep(0)
        assert index.workers["a"].state == DEGRADED and "worker gone" in index.workers["a"].reason
        no_call = sync.pull("b", object())  # a handle without the call: degraded, not a crash
        await asyncio.gather(no_call, return_exceptions=True)
        await asyncio.sleep(0)
        assert index.workers["b"].state == DEGRADED
        sync.forget("a")
        await sync.close()
        assert "a" not in index.workers

    asyncio.run(main())


def test_prefix_aware_routes_by_the_exact_index_and_counts_fallbacks():
    index = KVIndex(16)
    policy = make_policy("prefix-aware", 16, index)
    a, b = WorkerView("a", "p", "prefill"), WorkerView("b", "p", "prefill")
    b.remember([1, 2, 3], 1024)  # the router's guess says b; the workers' caches say a
    index.apply("a", snap("ea", 0, [1, 2, 3]))
    index.apply("b", snap("eb", 0, []))
    assert policy.pick_prefill([a, b], [1, 2, 3]) is a
    assert index.workers["a"].fallbacks == index.workers["b"].fallbacks == 0
    index.degrade("b", "kv_events failed")
    index.apply("a", snap("ea2", 0, []))  # a restarted empty
    assert policy.pick_prefill([a, b], [1, 2, 3]) is b  # b judged by the guess, and counted
    assert index.workers["b"].fallbacks == 1 and index.workers["a"].fallbacks == 0
    assert make_policy("prefix-aware", 16).pick_prefill([a, b], [1, 2, 3]) is b  # no index: the LRU (the simulator)


def test_prefix_aware_counts_what_a_fetch_would_save():
    """A prefill worker with nothing cached but a cheap fetch ahead of it beats one holding one
    page with a shorter queue; with no fetch to make, the queue decides again."""
    index = KVIndex(16)
    policy = make_policy("prefix-aware", 16, index)
    a, b = WorkerView("a", "p", "prefill"), WorkerView("b", "p", "prefill")
    index.apply("a", snap("ea", 0, [1]))
    index.apply("b", snap("eb", 0, []))
    a.inflight_tokens, b.inflight_tokens = 0, 10
    assert policy.pick_prefill([a, b], [1, 2, 3, 4]) is a  # 16 cached tokens against 10 queued ones
    assert policy.pick_prefill([a, b], [1, 2, 3, 4], {"b": 60.0, "a": 20.0}) is b  # 60 - 10 against 16 + 20
    for other in (make_policy("least-loaded", 16), make_policy("round-robin", 16)):
        other.pick_prefill([a, b], [1, 2], {"b": 1e9})  # they weigh no cache: accepted, ignored


def test_placed_pages_count_until_the_worker_confirms_or_contradicts_them():
    index = KVIndex(16, expect_s=60)
    index.apply("a", snap("e", 0, []))
    index.expect("a", [1, 2, 3])  # placed by this router, not computed yet (or not pulled yet)
    assert index.matched_pages("a", [1, 2, 3, 4]) == 3 and index.blocks("a") == set()
    index.apply("a", events("e", (1, STORED, [1, 2, 3])))  # confirmed: now the index's own
    assert index.workers["a"].expected == {} and index.matched_pages("a", [1, 2, 3]) == 3
    index.expect("a", [7, 8])
    index.apply("a", events("e", (2, CLEARED, [])))  # the worker reset its cache: nothing expected holds
    assert index.matched_pages("a", [1]) == 0 and index.matched_pages("a", [7]) == 0
    index.expect("a", [9])
    index.expect_s = 0.0  # expired
    assert index.matched_pages("a", [9]) == 0
