"""Layout conversion between a sender's pages and a receiver's pages, by token runs.

A run is `num_tokens` consecutive tokens of one layer starting at `token_start`, held as
`[2, num_tokens, heads, head_dim]` in the sender's dtype and head range. Reading gathers
them from the sender's pages; writing scatters them into the receiver's pages, keeping
only the heads the receiver holds and casting dtype. Page-size and head-range changes
both reduce to this one token-indexed copy, so token order is right by construction.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from kv_transfer.layout import KVLayout, torch_dtype


def head_overlap(a: KVLayout, b: KVLayout) -> tuple[int, int]:
    """Global head range both layouts hold; empty when lo >= hi."""
    return max(a.head_start, b.head_start), min(a.head_end, b.head_end)


def is_homogeneous(src: KVLayout, dst: KVLayout) -> bool:
    """Pages can move byte-for-byte: same page size, same heads, same dtype."""
    return (src.page_size == dst.page_size and src.head_start == dst.head_start
            and src.num_heads == dst.num_heads and src.dtype == dst.dtype)


def pages_of_run(page_ids: np.ndarray, page_size: int, token_start: int, num_tokens: int) -> np.ndarray:
    """The request pages that tokens [token_start, token_start + num_tokens) touch."""
    first = token_start // page_size
    last = (token_start + num_tokens - 1) // page_size
    return page_ids[first:last + 1]


def read_token_run(layer: torch.Tensor, page_ids: np.ndarray, layout: KVLayout,
                   token_start: int, num_tokens: int) -> torch.Tensor:
    """Gather a run from one layer's pages: contiguous `[2, num_tokens, heads, head_dim]`."""
    ps = layout.page_size
    pages = torch.from_numpy(np.ascontiguousarray(pages_of_run(page_ids, ps, token_start, num_tokens), dtype=np.int64))
    block = layer.index_select(0, pages)  # [k, 2, ps, H, D]
    tokens = block.transpose(0, 1).reshape(2, -1, layout.num_heads, layout.head_dim)
    off = token_start - (token_start // ps) * ps
    return tokens[:, off:off + num_tokens].contiguous()


def write_token_run(layer: torch.Tensor, page_ids: np.ndarray, dst: KVLayout, token_start: int,
                    data: torch.Tensor, src: KVLayout) -> None:
    """Scatter a run (in `src` heads and dtype) into one layer's pages of the receiver."""
    lo, hi = head_overlap(src, dst)
    if lo >= hi:
        return
    num_tokens = data.shape[1]
    piece = data[:, :, lo - src.head_start:hi - src.head_start]
    if piece.dtype != layer.dtype:
        piece = piece.to(layer.dtype)
    ps = dst.page_size
    h0, h1 = lo - dst.head_start, hi - dst.head_start
    whole = (num_tokens // ps) * ps if token_start % ps == 0 else 0
    if whole:
        # whole destination pages: page-granular copies (of the overlapping heads only, when the
        # receiver holds others too: a tensor-parallel rank's share), no per-token indexing
        block = piece[:, :whole].reshape(2, -1, ps, hi - lo, dst.head_dim).transpose(0, 1)
        heads = None if (h0, h1) == (0, dst.num_heads) else (h0, h1)
        write_pages(layer, page_ids[token_start // ps:(token_start + whole) // ps], block, heads)
        if whole == num_tokens:
            return
        piece, token_start, num_tokens = piece[:, whole:], token_start + whole, num_tokens - whole
    pos = np.arange(token_start, token_start + num_tokens)
    pages = torch.from_numpy(page_ids[pos // ps].astype(np.int64))
    offs = torch.from_numpy((pos % ps).astype(np.int64))
    # advanced indices around a slice put the token dim first: [n, 2, heads, D]
    layer[pages, :, offs, h0:h1] = piece.transpose(0, 1)


def page_spans(page_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive page ids: (position in page_ids, first page, length)."""
    pages = np.asarray(page_ids, dtype=np.int64)
    if len(pages) == 0:
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(pages)]))
    return [(int(a), int(pages[a]), int(b - a)) for a, b in zip(starts, ends)]


# Above this many spans per write, one index_copy_ beats a Python loop of slice copies.
_MAX_SPANS = 8


def write_pages(layer: torch.Tensor, page_ids: np.ndarray, block: torch.Tensor,
                heads: tuple[int, int] | None = None) -> None:
    """`layer[page_ids[i]] = block[i]` for every i; with `heads=(h0, h1)` only those heads of
    each page (`block` then holds h1 - h0 heads). Consecutive page ids are written as one
    slice copy each: on CPU a slice copy runs ~3x faster than `index_copy_` (a plain memcpy
    against a per-index kernel), and allocators hand out consecutive pages often."""
    target = layer if heads is None else layer[:, :, :, heads[0]:heads[1]]
    spans = page_spans(page_ids)
    if len(spans) > _MAX_SPANS:
        target.index_copy_(0, torch.from_numpy(np.ascontiguousarray(page_ids, dtype=np.int64)), block)
        return
    for pos, first, n in spans:
        target[first:first + n].copy_(block[pos:pos + n])


def plan_runs(num_tokens: int, src: KVLayout, dst: KVLayout, max_bytes: int) -> list[tuple[int, int]]:
    """Split a request's tokens into runs of at most `max_bytes` (at least one unit), each
    unit aligned to both page sizes so the receiver can copy whole pages when it can."""
    unit = math.lcm(src.page_size, dst.page_size)
    unit_bytes = unit * 2 * src.token_bytes
    per_run = max(1, max_bytes // unit_bytes) * unit
    return [(start, min(per_run, num_tokens - start)) for start in range(0, num_tokens, per_run)]


def cast_view(buffer: torch.Tensor, layout: KVLayout, num_pages: int) -> torch.Tensor:
    """View the first pages of a uint8 staging buffer as `[num_pages, 2, ps, H, D]`."""
    nbytes = num_pages * layout.page_bytes
    flat = buffer[:nbytes].view(torch_dtype(layout.dtype))
    return flat.view(num_pages, 2, layout.page_size, layout.num_heads, layout.head_dim)
