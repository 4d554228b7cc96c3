"""Request-level page accounting over the BlockPool: prefix-cache lookup, page allocation for
the tokens a step will compute, registration of newly full pages, and freeing.

It works on anything with `all_token_ids`, `pages`, `block_hashes` and `num_computed_tokens`
(engine.request.Request), so the prefill and decode workers share it unchanged.
"""
from __future__ import annotations

from typing import Protocol

from engine.block_hash import page_hashes
from engine.block_pool import BlockPool


class PagedSequence(Protocol):
    all_token_ids: list[int]
    pages: list[int]
    block_hashes: list[int]
    num_computed_tokens: int
    num_cached_pages_registered: int  # leading pages already offered to the prefix cache


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 verify_tokens: bool = True) -> None:
        self.page_size = page_size
        self.pool = BlockPool(num_pages, enable_prefix_caching, verify_tokens)

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    def find_cached_prefix(self, seq: PagedSequence) -> list[int]:
        """Pages holding the longest cached prefix of `seq`'s tokens (not yet referenced).

        At least one token is always left to compute: the model must run on the last token to
        produce the next one's logits.
        """
        if not self.pool.enable_prefix_caching:
            return []
        tokens = seq.all_token_ids
        seq.block_hashes = page_hashes(tokens, self.page_size, seq.block_hashes)
        max_pages = (len(tokens) - 1) // self.page_size
        hits: list[int] = []
        verify = self.pool.verify_tokens
        for i, block_hash in enumerate(seq.block_hashes[:max_pages]):
            page = self.pool.lookup(block_hash, tokens[i * self.page_size : (i + 1) * self.page_size] if verify else ())
            if page is None:
                break
            hits.append(page)
        return hits

    def allocate(self, seq: PagedSequence, num_new_tokens: int, cached_pages: list[int] = ()) -> bool:
        """Give `seq` pages for `num_new_tokens` beyond what it has computed (after taking
        `cached_pages` as its prefix). All or nothing: False, with no change, if pages are short."""
        ps = self.page_size
        have = len(seq.pages)
        if not cached_pages:  # the common case, once per running request and step
            need = -(-(seq.num_computed_tokens + num_new_tokens) // ps)
            if need <= have:
                return True
            if need - have > self.pool.num_free_pages:
                return False
            seq.pages.extend(self.pool.allocate(need - have))
            return True
        have += len(cached_pages)
        need = pages_for(seq.num_computed_tokens + len(cached_pages) * ps + num_new_tokens, ps)
        # Cached pages sitting in the free queue stop being free once referenced.
        cached_free = sum(1 for p in cached_pages if self.pool.ref_counts[p] == 0)
        if need - have > self.pool.num_free_pages - cached_free:
            return False
        self.pool.touch(cached_pages)
        seq.pages.extend(cached_pages)
        if need > have:
            seq.pages.extend(self.pool.allocate(need - have))
        return True

    def cache_full_pages(self, seq: PagedSequence) -> None:
        """Register pages whose tokens are all computed so later requests can reuse them."""
        full = seq.num_computed_tokens // self.page_size
        done = seq.num_cached_pages_registered
        if full <= done or not self.pool.enable_prefix_caching:
            return  # most steps: the decoded token did not fill a page
        ps = self.page_size
        tokens = seq.all_token_ids
        if len(seq.block_hashes) < full:
            seq.block_hashes = page_hashes(tokens, ps, seq.block_hashes, full)  # (no copy of the tokens)
        self.pool.cache_pages(seq.pages, seq.block_hashes, tokens, done, full, ps)
        seq.num_cached_pages_registered = full

    def free(self, seq: PagedSequence) -> None:
        self.pool.free(reversed(seq.pages))
        seq.pages = []
        seq.num_cached_pages_registered = 0
