"""GPU suites: each module skips itself without CUDA (and flashinfer where it needs it).

`random_paged_batch` builds one step's `BatchLayout` over a randomly filled paged KV cache:
sequences with a cached prefix in scattered pages, decode-shaped first, as the runner would.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.attention import BatchLayout


@dataclass(slots=True)
class PagedBatch:
    layout: BatchLayout
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [num_pages, 2, page_size, Hkv, D], prefixes filled, rest random too


def random_paged_batch(
    seqs: list[tuple[int, int]],  # (cached_len, query_len) per sequence, decodes (query_len 1) first
    *, page_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device, seed: int = 0, spare_pages: int = 7,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    query_lens = [q for _, q in seqs]
    context_lens = [c + q for c, q in seqs]
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(seqs))
    if any(q == 1 for q in query_lens[num_decodes:]):
        raise ValueError("decode-shaped sequences (query_len 1) must come first")
    pages_needed = [-(-c // page_size) for c in context_lens]
    num_pages = sum(pages_needed) + spare_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()  # scattered, never page-ordered
    block_tables, start = [], 0
    for n in pages_needed:
        block_tables.append(perm[start : start + n])
        start += n
    slots = []
    for (cached, q_len), table in zip(seqs, block_tables):
        pos = torch.arange(cached, cached + q_len)
        pages = torch.tensor(table, dtype=torch.long)[pos // page_size]
        slots.append(pages * page_size + pos % page_size)
    t = sum(query_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    layout = BatchLayout(
        page_size=page_size, query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
        num_decodes=num_decodes, slot_mapping=torch.cat(slots).to(device),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device),
        device=device,
    )
    return PagedBatch(
        layout, randn(t, num_q_heads, head_dim), randn(t, num_kv_heads, head_dim), randn(t, num_kv_heads, head_dim),
        randn(num_pages, 2, page_size, num_kv_heads, head_dim),
    )


@pytest.fixture
def make_paged_batch():
    """The builder above as a fixture, so test modules need not import conftest."""
    return random_paged_batch
