"""The page pool: who owns each KV page, which free pages still hold a cached prefix.

- Every page has a reference count. A page with refcount 0 is free: either in the plain free
  list (holds nothing worth keeping, handed out first) or in the cached free queue, an
  OrderedDict used as an O(1) LRU list (evict from the front, append at the back, remove from
  the middle on a cache hit).
- A full page may carry a block hash (see block_hash.py) and stays findable by it after its
  owner frees it, until it is handed out again (evicted) from the front of the free queue.
  A hit compares the page's token ids, so a hash collision can never serve wrong KV.
- A caller whose block hashes name page contents exactly (the capacity planner's simulator
  builds them so: equal hashes if and only if equal prefixes) may turn the token comparison
  off (`verify_tokens=False`): pages then keep no copy of their tokens.
- Free pages count as free whether or not they hold cached data: after every request is
  finished, `num_free_pages == num_pages`.
- Pages never handed out are counted, not listed: the first allocation of page p extends the
  per-page lists to p, so a pool's cost follows the pages it has used, not its size (the
  simulator's pools with unbounded memory have a billion pages).
- `events`, when set (engine/kv_events.py KVEventLog), hears every block hash that enters or
  leaves the prefix cache (stored, evicted, cleared); unset, it costs one `is None` test.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class OutOfPagesError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_pages: int, enable_prefix_caching: bool = True, verify_tokens: bool = True) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.verify_tokens = verify_tokens
        self.ref_counts: list[int] = []  # per page handed out so far (pages 0 .. len - 1)
        self._free_plain: list[int] = []  # freed pages holding nothing to keep, a stack
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._page_info: list[tuple[int, tuple[int, ...]] | None] = []  # (block hash, tokens) per page used
        self._by_hash: dict[int, int] = {}
        self.events = None  # a KVEventLog told of every change to _by_hash, or None (nobody listens)
        self.queries = 0  # pages looked up in the prefix cache
        self.hits = 0

    @property
    def num_free_pages(self) -> int:
        return len(self._free_plain) + len(self._free_cached) + self.num_pages - len(self.ref_counts)

    @property
    def num_cached_pages(self) -> int:
        return len(self._by_hash)

    def allocate(self, n: int) -> list[int]:
        """n pages with refcount 1, evicting the least recently freed cached pages first.
        Handed out in this order: plain free pages (the most recently freed first), then pages
        never used (ascending), then cached free pages (least recently freed first). A long
        prompt takes hundreds of pages at once, so the first two come in slices."""
        if n > self.num_free_pages:
            raise OutOfPagesError(f"need {n} pages, {self.num_free_pages} free")
        ref_counts = self.ref_counts
        plain = self._free_plain
        k = min(n, len(plain))
        if k:
            pages = plain[: -k - 1: -1]  # popped from the top of the stack, one by one
            del plain[-k:]
            for page in pages:
                ref_counts[page] = 1
        else:
            pages = []
        k = min(n - k, self.num_pages - len(ref_counts))
        if k > 0:  # the next pages never used
            first = len(ref_counts)
            pages.extend(range(first, first + k))
            ref_counts.extend([1] * k)
            self._page_info.extend([None] * k)
        rest = n - len(pages)
        if rest:  # evicted, least recently freed first: their cache entries go
            popitem, info, by_hash = self._free_cached.popitem, self._page_info, self._by_hash
            evicted = [popitem(False)[0] for _ in range(rest)]
            entries = [info[page] for page in evicted]
            dropped = [] if self.events is not None else None
            for page, entry in zip(evicted, entries):
                if entry is not None:
                    info[page] = None
                    if by_hash.get(entry[0]) == page:
                        del by_hash[entry[0]]
                        if dropped is not None:
                            dropped.append(entry[0])
                ref_counts[page] = 1
            if dropped:
                self.events.evicted(*dropped)
            pages += evicted
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page. Pass a request's pages in reverse order, so that
        its tail (the least shared part) is evicted before its head."""
        ref_counts, info = self.ref_counts, self._page_info
        plain, cached = self._free_plain, self._free_cached
        for page in pages:
            count = ref_counts[page] - 1
            assert count >= 0, f"page {page} freed more often than allocated"
            ref_counts[page] = count
            if not count:
                if info[page] is None:
                    plain.append(page)
                else:
                    cached[page] = None

    def touch(self, pages: Iterable[int]) -> None:
        """Take one more reference to pages found in the prefix cache."""
        for page in pages:
            if self.ref_counts[page] == 0:
                del self._free_cached[page]  # only cached pages are ever found again
            self.ref_counts[page] += 1

    def cache_page(self, page: int, block_hash: int, token_ids: Sequence[int]) -> None:
        if not self.enable_prefix_caching or self._page_info[page] is not None:
            return
        if block_hash in self._by_hash:  # same content already cached in another page
            return
        self._page_info[page] = (block_hash, tuple(token_ids) if self.verify_tokens else None)
        self._by_hash[block_hash] = page
        if self.events is not None:
            self.events.stored((block_hash,))

    def cache_pages(self, pages: Sequence[int], hashes: Sequence[int], token_ids: Sequence[int], first: int,
                    end: int, page_size: int) -> None:
        """`cache_page` for pages[first:end], whose tokens are token_ids[i * page_size:][:page_size]
        (a long prompt registers hundreds of pages at once)."""
        if not self.enable_prefix_caching:
            return
        info, by_hash = self._page_info, self._by_hash
        if self.events is not None:  # what the loop below will register (chained hashes never repeat)
            stored = [hashes[i] for i in range(first, end) if info[pages[i]] is None and hashes[i] not in by_hash]
            if stored:
                self.events.stored(stored)
        if not self.verify_tokens:
            for i in range(first, end):
                page, block_hash = pages[i], hashes[i]
                if info[page] is None and block_hash not in by_hash:
                    info[page] = (block_hash, None)
                    by_hash[block_hash] = page
            return
        tokens = None  # token_ids[first * page_size:end * page_size] as one tuple, sliced per page
        for i in range(first, end):
            page, block_hash = pages[i], hashes[i]
            if info[page] is None and block_hash not in by_hash:
                if tokens is None:
                    tokens = tuple(token_ids[first * page_size:end * page_size])
                at = (i - first) * page_size
                info[page] = (block_hash, tokens[at:at + page_size])
                by_hash[block_hash] = page

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        """The page holding exactly these tokens under this chained hash, or None."""
        self.queries += 1
        page = self._by_hash.get(block_hash)
        if page is None:
            return None
        info = self._page_info[page]
        if info is None or (self.verify_tokens and info[1] != tuple(token_ids)):
            return None
        self.hits += 1
        return page

    def reset_prefix_cache(self) -> None:
        for page in list(self._by_hash.values()):
            self._page_info[page] = None
        self._by_hash.clear()
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        if self.events is not None:
            self.events.cleared()

    def cached_hashes(self) -> list[int]:
        """Every block hash in the prefix cache now."""
        return list(self._by_hash)
