"""The attention backend contract.

Per step the runner builds one `BatchLayout` (shared by all layers) and calls
`backend.plan(layout)` once; then each layer calls `backend.forward(layer, q, k, v, kv_cache)`,
which writes the step's new K/V into the paged cache and attends over every sequence's full
context (cached prefix pages + the new tokens).

Batch order: sequences with exactly one new token ("decode-shaped") come first
(`[0, num_decodes)`), then the multi-token ("prefill-shaped") ones. Query tokens are packed
(no padding) in that same order.

KV cache layout (one tensor per layer, FlashInfer's NHD paged layout):
    kv_cache[num_pages, 2, page_size, num_kv_heads, head_dim]; [:, 0] is K and [:, 1] is V.
A token at absolute position `p` of a sequence lives in page `block_table[p // page_size]`
at offset `p % page_size`; its flat slot is `page * page_size + offset`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class BatchLayout:
    """Shape of one forward step. Python lists are the source of truth; tensors live on `device`."""

    page_size: int
    query_lens: list[int]  # new tokens per sequence this step
    context_lens: list[int]  # tokens in KV per sequence after this step (cached + new)
    block_tables: list[list[int]]  # page ids per sequence, at least ceil(context_len / page_size)
    num_decodes: int  # sequences [0, num_decodes) have query_len == 1
    slot_mapping: torch.Tensor  # int64 [num_tokens]: flat slot of each new token
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: prefix sums of query_lens
    device: torch.device

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))


@dataclass(slots=True, frozen=True)
class AttentionSpec:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    device: torch.device
    scale: float


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter new K/V ([T, Hkv, D]) into their pages at `slot_mapping`."""
    num_pages, _, page_size, h, d = kv_cache.shape
    flat = kv_cache.view(num_pages * 2 * page_size, h, d)
    page = torch.div(slot_mapping, page_size, rounding_mode="floor")
    k_rows = page * (2 * page_size) + (slot_mapping - page * page_size)
    flat.index_copy_(0, k_rows, k.to(kv_cache.dtype))
    flat.index_copy_(0, k_rows + page_size, v.to(kv_cache.dtype))


class AttentionBackend(ABC):
    """One instance per engine; stateless across steps except what `plan` prepares."""

    name: str = "base"

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @abstractmethod
    def plan(self, layout: BatchLayout) -> None:
        """Prepare per-step metadata (index tensors, masks, kernel plans) shared by all layers."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [T, num_q_heads, head_dim]
        """Write this step's K/V into `kv_cache`, then attend causally over each sequence's context."""
