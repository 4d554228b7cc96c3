"""Chained, deterministic hashes of full KV pages.

A page's hash covers its parent page's hash and its own token ids, so equal hashes mean equal
prefixes. The function is plain blake2b over fixed-width integers: the same value in every
process and on every machine (Python's `hash()` is salted per process, so it is never used).
The router computes the same hashes to route by prefix-cache affinity.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0  # parent of a sequence's first page


def hash_page(parent: int, token_ids: Sequence[int]) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def page_hashes(token_ids: Sequence[int], page_size: int, start: Sequence[int] = (),
                num_pages: int | None = None) -> list[int]:
    """Hashes of every full page of `token_ids` (of its first `num_pages` pages, if given);
    `start` holds already-known leading hashes."""
    hashes = list(start)
    parent = hashes[-1] if hashes else ROOT_HASH
    end = len(token_ids) // page_size
    if num_pages is not None and num_pages < end:
        end = num_pages
    for i in range(len(hashes), end):
        parent = hash_page(parent, token_ids[i * page_size : (i + 1) * page_size])
        hashes.append(parent)
    return hashes
