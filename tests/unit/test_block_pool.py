"""Block pool and prefix hashes: refcounts, LRU eviction of cached free pages, verification of
tokens on a hit, and hashes that agree across processes."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine.block_hash import hash_page, page_hashes
from engine.block_pool import BlockPool, OutOfPagesError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def test_allocate_and_free_restore_every_page():
    pool = BlockPool(8)
    a = pool.allocate(5)
    assert len(set(a)) == 5 and pool.num_free_pages == 3
    with pytest.raises(OutOfPagesError):
        pool.allocate(4)
    pool.free(reversed(a))
    assert pool.num_free_pages == 8


def test_shared_page_is_freed_only_by_its_last_owner():
    pool = BlockPool(4)
    (page,) = pool.allocate(1)
    pool.cache_page(page, 123, [1, 2])
    pool.free([page])
    assert pool.lookup(123, [1, 2]) == page
    pool.touch([page])
    pool.touch([page])
    assert pool.ref_counts[page] == 2 and pool.num_free_pages == 3
    pool.free([page])
    assert pool.num_free_pages == 3
    pool.free([page])
    assert pool.num_free_pages == 4


def test_plain_free_pages_are_reused_before_cached_ones_and_lru_evicts_oldest():
    pool = BlockPool(4)
    pages = pool.allocate(4)
    for i, p in enumerate(pages[:3]):
        pool.cache_page(p, 100 + i, [i])
    pool.free(pages)  # three cached (freed in order 0, 1, 2), one plain
    assert pool.allocate(1) == [pages[3]]  # the plain page goes first
    assert pool.allocate(1) == [pages[0]]  # then the least recently freed cached page
    assert pool.lookup(100, [0]) is None  # ...whose cache entry is gone
    assert pool.lookup(101, [1]) == pages[1]


def test_hash_hit_with_different_tokens_is_a_miss():
    pool = BlockPool(2)
    (page,) = pool.allocate(1)
    pool.cache_page(page, 7, [1, 2, 3])
    assert pool.lookup(7, [1, 2, 4]) is None
    assert pool.lookup(7, [1, 2, 3]) == page
    pool.free([page])


def test_chained_hashes_depend_on_the_whole_prefix():
    a = page_hashes([1, 2, 3, 4, 5, 6], 2)
    b = page_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))
    assert page_hashes([1, 2, 3, 4, 5, 6, 7], 2) == a  # a partial page has no hash
    assert page_hashes([1, 2, 3, 4, 5, 6], 2, start=a[:1]) == a


def test_hashes_are_the_same_in_another_process():
    code = "from engine.block_hash import page_hashes; print(page_hashes(list(range(64)), 16))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(page_hashes(list(range(64)), 16))
    assert hash_page(0, [1, 2]) == hash_page(0, [1, 2]) != hash_page(1, [1, 2])


def _req(tokens):
    return Request(request_id="r", prompt_token_ids=list(tokens), params=SamplingParams(), max_total_tokens=len(tokens) + 16)


def test_manager_finds_cached_prefix_and_allocates_all_or_nothing():
    kv = KVCacheManager(num_pages=6, page_size=4)
    first = _req(range(10))
    assert kv.allocate(first, 10)
    first.num_computed_tokens = 10
    kv.cache_full_pages(first)  # pages 0-1 full, page 2 partial
    second = _req(list(range(8)) + [50, 51, 52])
    hits = kv.find_cached_prefix(second)
    assert hits == first.pages[:2]
    assert not kv.allocate(second, 100, hits)  # too big: nothing taken
    assert second.pages == [] and kv.num_free_pages == 3
    assert kv.allocate(second, 3, hits)
    assert second.pages[:2] == first.pages[:2] and kv.num_free_pages == 2
    kv.free(first)
    kv.free(second)
    assert kv.num_free_pages == 6


def test_a_pool_without_token_checks_hits_by_hash_and_hands_out_pages_in_the_same_order():
    """verify_tokens=False (hashes that name contents exactly, as the simulator's): a hit needs
    only the hash, pages keep no token copy, and every page goes where it would with checks."""
    import random

    checked, unchecked = BlockPool(64), BlockPool(64, verify_tokens=False)
    page = unchecked.allocate(1)[0]
    unchecked.cache_page(page, 7, [1, 2, 3])
    assert unchecked.lookup(7, ()) == page and unchecked._page_info[page] == (7, None)
    unchecked.free([page])
    checked.cache_page(checked.allocate(1)[0], 7, [1, 2, 3])
    checked.free([0])
    rng = random.Random(5)
    owned: list[list[int]] = []
    for step in range(400):
        if owned and rng.random() < 0.45:
            pages = owned.pop(rng.randrange(len(owned)))
            checked.free(reversed(pages))
            unchecked.free(reversed(pages))
            continue
        n = rng.randrange(1, 9)
        if n > checked.num_free_pages:
            continue
        a, b = checked.allocate(n), unchecked.allocate(n)
        assert a == b
        hashes = [rng.randrange(40) for _ in a]
        toks = [h * 3 for h in hashes for _ in range(2)]
        checked.cache_pages(a, hashes, toks, 0, len(a), 2)
        unchecked.cache_pages(b, hashes, toks, 0, len(b), 2)
        assert checked._by_hash == unchecked._by_hash and list(checked._free_cached) == list(unchecked._free_cached)
        owned.append(a)
