"""The node KV store (kv_store/store.py, issue 37 items 2 and 4), in process over real NIXL (UCX on
host memory) and real gRPC on 127.0.0.1, with the tiny llama. The test plays the router: after a
turn it has the decode worker send the turn's full pages into the store (`offload` ->
`export_prefix`), and for the next turn it has a prefill worker whose cache is empty fetch them
from the store (`submit(remote_prefix)` -> the store's `export_prefix`).

Covered: the next turn fetched from the store, greedy tokens equal to Hugging Face's and to the
tier off; an offload sending only the pages the store lacks, and one that finds them all (LRU
refresh, nothing sent); LRU eviction in a full store, and the KV events the router's index reads;
a page leased by a send is not evicted; a pinned prefix survives a full store until unpinned; a
worker that evicted the pages sends nothing (the offload is abandoned); the store closed during a
fetch (the prefill worker computes the prompt, same tokens). After every test: every page free
on every worker and in the store (but pinned ones), nothing tracked by any connector.
"""
from __future__ import annotations

import pytest

from engine.outputs import RemotePrefix
from kv_store import KVStore
from kv_transfer.config import TransferConfig
from prefill_worker import PrefillTask
from tests.helpers import hf_greedy, random_prompts, wait_until
from tests.integration.test_prefix_fetch import ENGINE, GREEDY, NEW_TOKENS, PAGE, Router, _pair, assert_nothing_held

STORE_PAGES = 12


@pytest.fixture(scope="module")
def turns(tiny_model):
    """(x, answer, y, want): turn 1's prompt x (70 tokens), its greedy answer, turn 2's prompt
    y = x + answer + 20 new tokens, and y's greedy tokens from transformers."""
    model = tiny_model("llama")
    x, tail = random_prompts((70, 20), 2048, seed=41)
    answer = hf_greedy(model, [x], NEW_TOKENS)[0]
    y = x + answer + tail
    return x, answer, y, hf_greedy(model, [y], NEW_TOKENS)[0]


def _store(model, transport: str, pages: int = STORE_PAGES, deadline_s: float = 4.0) -> KVStore:
    return KVStore(model, size_bytes=KVStore.page_bytes_of(model, PAGE) * pages, page_size=PAGE, transport=transport,
                   transfer_config=TransferConfig(deadline_s=deadline_s, liveness_interval_s=0.1))


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def cluster(request, tiny_model):
    model = tiny_model("llama")
    p, d = _pair(model, request.param)
    s = _store(model, request.param)
    yield p, d, s
    for w in (p, d, s):
        w.close()


@pytest.fixture
def parts(cluster):
    p, d, s = cluster
    for w in (p.core, d.core, s):
        w.reset_prefix_cache()
    yield p, d, s
    for name in list(s.pins):
        s.unpin(name)
    wait_until(lambda: settled(p, d, s), timeout_s=15, what="workers and store idle")
    assert_nothing_held(p, d)
    assert_store_empty(s)


def settled(*ws) -> bool:
    for w in ws:
        w.step()
    return not any(w.has_requests for w in ws)


def assert_store_empty(s: KVStore) -> None:
    st = s.stats()
    assert st["free_pages"] == st["num_pages"] and not st["ingesting"] and not st["exporting"], st
    assert s.connector.tracking == {"sending": 0, "receiving": 0, "fetching": 0}, s.connector.tracking
    assert s.connector.sender.tracked_pages() == [] and s.connector.receiver.tracked_pages() == []


def offload(s: KVStore, holder, rid: str, tokens: list[int], step=()) -> int:
    """What the router does after a turn: the store asks for the pages it lacks, the worker that
    holds them sends them. Returns the tokens sent."""
    fetch = s.offload(rid, tokens)
    if fetch is None:
        return 0
    exp = holder.export_prefix(fetch, tokens)
    if not exp.sending:
        assert s.abandon_fetch(rid)
    wait_until(lambda: settled(*step, holder, s), timeout_s=10, what="offload received")
    return exp.num_tokens


def turn_one(p, d, s, x) -> tuple[Router, list[int]]:
    r = Router(p, d)
    r.disaggregated("x", x)
    r.run()
    tokens = x + r.tokens["x"][:-1]  # the last token's KV is never computed
    return r, tokens


def test_next_turn_fetches_from_the_store(parts, turns):
    p, d, s = parts
    x, answer, y, want = turns
    r, tokens = turn_one(p, d, s, x)
    assert r.tokens["x"] == answer
    k = len(tokens) // PAGE
    assert offload(s, d, "x.kv", tokens, (p, d)) == k * PAGE
    assert s.stats()["cached_pages"] == k and s.stats()["offloads"] == 1
    for w in (p, d):
        w.core.reset_prefix_cache()  # the workers forgot turn 1: only the store holds it
    before = p.core.num_computed_prompt_tokens
    r.disaggregated("y", y, fetch_pages=k, holder=s)
    r.run()
    assert r.finished["y"] == ("length", None) and r.tokens["y"] == want
    assert r.exports["y"].num_tokens == k * PAGE and r.cached["y"] == k * PAGE
    assert p.core.num_computed_prompt_tokens - before == len(y) - k * PAGE
    assert s.stats()["exported_tokens"] == k * PAGE and s.load().prefix_cache_hit_rate == 1.0
    assert r.fetch_s["y"] > 0, "the prefill worker reports its wait for the fetched pages (the router learns from it)"

    p.core.reset_prefix_cache()  # the tier off: the same tokens
    r.disaggregated("y-off", y)
    r.run()
    assert r.tokens["y-off"] == want and r.cached["y-off"] == 0 and r.fetch_s["y-off"] is None


def test_offload_sends_only_what_the_store_lacks(parts, turns):
    p, d, s = parts
    x, answer, y, want = turns
    _, tokens = turn_one(p, d, s, x)
    assert offload(s, d, "a", tokens[:2 * PAGE], (p, d)) == 2 * PAGE
    fetch = s.offload("b", tokens)
    assert fetch.start_token == 2 * PAGE and fetch.num_tokens == (len(tokens) // PAGE - 2) * PAGE
    assert d.export_prefix(fetch, tokens).sending
    wait_until(lambda: settled(p, d, s) and s.stats()["cached_pages"] == len(tokens) // PAGE, what="received")
    assert s.offload("c", tokens) is None and s.stats()["refreshed"] == 1, "all there: nothing to send"


def test_a_full_store_evicts_the_least_recently_used(parts, turns):
    """Two conversations of 4 pages each in a store of 12, a third evicts the least recently used
    (the first, unless it was read since); the events the router's index reads say so."""
    p, d, s = parts
    x, answer, y, want = turns
    convs = random_prompts((4 * PAGE, 4 * PAGE, 5 * PAGE), 2048, seed=3)
    r = Router(p, d)
    for i, c in enumerate(convs[:2]):
        r.disaggregated(f"c{i}", c)
    r.run()
    batch = s.kv_events("", 0)
    for i, c in enumerate(convs[:2]):
        assert offload(s, d, f"c{i}.kv", c, (p, d)) == 4 * PAGE
    assert s.offload("c0.again", convs[0]) is None  # c0 read again: c1 is now the least recent
    r.disaggregated("c2", convs[2])
    r.run()
    assert offload(s, d, "c2.kv", convs[2], (p, d)) == 5 * PAGE
    events = s.kv_events(batch.epoch, batch.seq).events
    evicted = {h for e in events if e.kind == "evicted" for h in e.block_hashes}
    from engine.block_hash import page_hashes
    assert evicted and evicted <= set(page_hashes(convs[1], PAGE, [])), "c1's pages, least recently used, went"
    assert s.cached_prefix_tokens(convs[0]) // PAGE == 4 and s.cached_prefix_tokens(convs[2]) // PAGE == 5


def test_a_leased_page_is_not_evicted(parts, turns):
    """Pages a send is reading stay until the send ends, whatever an offload needs."""
    p, d, s = parts
    x, answer, y, want = turns
    _, tokens = turn_one(p, d, s, x)
    k = len(tokens) // PAGE
    offload(s, d, "x.kv", tokens, (p, d))
    p.core.reset_prefix_cache()
    fetch = p.submit(PrefillTask("lease", tokens + [1], GREEDY, [d.admit("lease", tokens + [1], GREEDY).descriptors[0]],
                                 RemotePrefix(k)))
    exp = s.export_prefix(fetch, tokens + [1])  # the store does not step: the send's release waits
    assert exp.sending and s.stats()["exporting"] == 1
    other = random_prompts((STORE_PAGES * PAGE,), 2048, seed=5)[0]
    r = Router(p, d)
    r.disaggregated("o", other[:6 * PAGE])
    fetch_o = s.offload("o.kv", other)  # wants 12 pages: only the 12 - k unleased ones are offered
    assert fetch_o.num_tokens == (STORE_PAGES - k) * PAGE
    assert s.abandon_fetch("o.kv")
    r.tokens["lease"] = []
    r.run()
    assert r.finished["lease"] == ("length", None)


def test_a_pinned_prefix_survives_a_full_store(parts, turns):
    p, d, s = parts
    x, answer, y, want = turns
    _, tokens = turn_one(p, d, s, x)
    k = len(tokens) // PAGE
    offload(s, d, "x.kv", tokens, (p, d))
    assert s.pin("system", tokens) == k * PAGE
    others = random_prompts((4 * PAGE,) * 4, 2048, seed=9)
    r = Router(p, d)
    for i, c in enumerate(others):
        r.disaggregated(f"o{i}", c)
    r.run()
    for i, c in enumerate(others):
        offload(s, d, f"o{i}.kv", c, (p, d))
    assert s.cached_prefix_tokens(tokens) // PAGE == k, "pinned: still there after 16 pages went through a store of 12"
    assert s.unpin("system") and not s.unpin("system")
    for i, c in enumerate(others):
        offload(s, d, f"o{i}.again", c, (p, d))
    assert s.cached_prefix_tokens(tokens) // PAGE < k


def test_a_worker_that_evicted_the_pages_sends_nothing(parts, turns):
    p, d, s = parts
    x, answer, y, want = turns
    _, tokens = turn_one(p, d, s, x)
    d.core.reset_prefix_cache()
    assert offload(s, d, "x.kv", tokens, (p, d)) == 0
    assert s.stats()["cached_pages"] == 0


def test_store_closed_during_a_fetch(tiny_model, turns, monkeypatch):
    """The store goes away in the middle of a send (its KV went, its final notice never will):
    the prefill worker hears it and computes the whole prompt; the tokens are the same."""
    model = tiny_model("llama")
    x, answer, y, want = turns
    for transport in ("nixl", "grpc"):
        p, d = _pair(model, transport, deadline_s=2.0)
        s = _store(model, transport, deadline_s=2.0)
        try:
            _, tokens = turn_one(p, d, s, x)
            k = len(tokens) // PAGE
            offload(s, d, "x.kv", tokens, (p, d))
            for w in (p, d):
                w.core.reset_prefix_cache()
            monkeypatch.setattr(s.connector.sender, "finish", lambda *args: None)
            r = Router(p, d)
            r.disaggregated("y", y, fetch_pages=k, holder=s)
            assert r.exports["y"].num_tokens == k * PAGE
            s.close()
            before = p.core.num_computed_prompt_tokens
            r.run(timeout_s=30)
            assert r.finished["y"] == ("length", None) and r.tokens["y"] == want, transport
            assert p.core.prefix.num_failed_fetches == 1 and p.core.num_computed_prompt_tokens - before == len(y)
            wait_until(lambda: settled(p, d), timeout_s=15, what="idle")
            assert_nothing_held(p, d)
        finally:
            monkeypatch.undo()
            for w in (p, d):
                w.close()


def test_bad_input_names_the_field(tiny_model):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kv_store.size must hold at least one page"):
        KVStore(model, size_bytes=100, page_size=PAGE, transport="grpc")
    s = _store(model, "grpc", pages=2)
    try:
        with pytest.raises(ValueError, match="request_id"):
            s.offload("", [1] * PAGE)
        with pytest.raises(ValueError, match="pin name"):
            s.pin("", [1] * PAGE)
        assert s.offload("short", [1] * (PAGE - 1)) is None
    finally:
        s.close()
