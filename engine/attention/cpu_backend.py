"""CPU attention: decode-shaped sequences through a compiled kernel that reads K/V in place.

The torch backend gathers every decode's K/V rows into a contiguous copy and runs SDPA on it,
so each byte of context is read from memory, written, and read again. On a CPU a decode step is
bound by those reads. `csrc/paged_decode.cpp` walks each sequence's pages directly, scoring a
chunk of tokens for all query heads at once and folding it into an online softmax, so the
context is read once (docs/benchmarks.md, "CPU decode attention kernel").

Prefill-shaped sequences (many query tokens: compute-bound) stay on the torch backend's SDPA.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.attention import cpu_ext
from engine.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, spec) -> None:
        if torch.device(spec.device).type != "cpu":
            raise ValueError(f"attention_backend='cpu' needs a CPU device, got {torch.device(spec.device).type!r}")
        cpu_ext.load()  # raises with the reason when the kernel cannot be built here
        super().__init__(spec)
        self.portable = False  # True: the kernel's plain-C loop even where its AVX2 one runs (tests)

    def _plan_decodes(self, decodes, kv_rows, dev) -> list:
        """Per decode: its query row, page table (int32, zero-padded) and context length."""
        self.decodes: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None
        if not decodes:
            return []
        ps = self.layout.page_size
        num_pages = [-(-ctx // ps) for ctx, _, _ in decodes]
        tables = np.zeros((len(decodes), max(num_pages)), dtype=np.int32)
        for r, ((_, _, i), p) in enumerate(zip(decodes, num_pages)):
            tables[r, :p] = self.layout.block_tables[i][:p]
        lens = torch.tensor([ctx for ctx, _, _ in decodes], dtype=torch.int32)
        rows = [row for _, row, _ in decodes]
        # The batch order puts decodes first (base.py): then q and out are used in place.
        row_index = None if rows == list(range(len(rows))) else torch.tensor(rows, dtype=torch.int64)
        self.decodes = (row_index, torch.from_numpy(tables), lens)
        return []

    def _attend_decodes(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        if self.decodes is None:
            return
        row_index, tables, lens = self.decodes
        if row_index is None:
            n = lens.numel()
            cpu_ext.paged_decode_attention(out[:n], q[:n].contiguous(), kv_cache, tables, lens, self.spec.scale,
                                           portable=self.portable)
        else:
            o = torch.empty((row_index.numel(), *q.shape[1:]), dtype=q.dtype)
            cpu_ext.paged_decode_attention(o, q.index_select(0, row_index), kv_cache, tables, lens, self.spec.scale,
                                           portable=self.portable)
            out.index_copy_(0, row_index, o)
