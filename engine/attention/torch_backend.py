"""Reference attention in plain torch (CPU and CUDA).

Per step, `plan` turns every sequence that reads cached K/V into row indices of the flat
cache view (`[num_pages * 2 * page_size, H, D]`, K row = page * 2 * page_size + offset, its V
row is page_size further). Per layer, `forward` gathers exactly those rows once for the whole
batch (two index_selects: no padding, no per-page copies) and runs one SDPA per sequence on
slices of them:
- decode-shaped (one query token): the query heads of each KV group are packed as a short
  query over that group's keys (shape [1, Hkv, group, D]); every key is valid, so no mask.
  (Padded, masked, GQA-expanded batches were ~5x slower on CPU.)
- prefill-shaped with nothing cached: causal SDPA straight on the step's new K/V.
- prefill-shaped after a cached prefix: SDPA over the gathered context with an offset
  causal mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, BatchLayout, write_kv


@dataclass(slots=True)
class _Seq:
    q_start: int
    q_end: int
    ctx_start: int  # slice of the gathered rows holding this sequence's context; -1 if none
    ctx_end: int
    mask: torch.Tensor | None  # offset causal mask [q_len, context_len] after a cached prefix


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, layout: BatchLayout) -> None:
        self.layout = layout
        ps, dev = layout.page_size, layout.device
        offsets = np.arange(ps, dtype=np.int64)
        rows: list[np.ndarray] = []
        n_rows = 0
        self.seqs: list[_Seq] = []
        q_start = 0
        for i, (q_len, ctx) in enumerate(zip(layout.query_lens, layout.context_lens)):
            q_end = q_start + q_len
            if q_len == ctx and q_len > 1:  # fresh prefill: attends only to its own new tokens
                self.seqs.append(_Seq(q_start, q_end, -1, -1, None))
            else:
                pages = np.asarray(layout.block_tables[i][: -(-ctx // ps)], dtype=np.int64)
                rows.append((pages[:, None] * (2 * ps) + offsets[None, :]).reshape(-1)[:ctx])
                mask = None
                if q_len > 1:
                    q_pos = torch.arange(ctx - q_len, ctx, device=dev)
                    mask = torch.arange(ctx, device=dev)[None, :] <= q_pos[:, None]
                self.seqs.append(_Seq(q_start, q_end, n_rows, n_rows + ctx, mask))
                n_rows += ctx
            q_start = q_end
        self.rows = torch.from_numpy(np.concatenate(rows)).to(dev) if rows else None

    def forward(self, layer, q, k, v, kv_cache):
        layout = self.layout
        write_kv(kv_cache, layout.slot_mapping, k, v)
        scale = self.spec.scale
        num_kv, group = self.spec.num_kv_heads, self.spec.num_q_heads // self.spec.num_kv_heads
        head_dim = q.shape[-1]
        if self.rows is not None:
            flat = kv_cache.view(-1, num_kv, head_dim)
            keys = flat.index_select(0, self.rows)
            values = flat.index_select(0, self.rows + layout.page_size)
        out = torch.empty_like(q)
        for s in self.seqs:
            if s.ctx_start < 0:
                o = F.scaled_dot_product_attention(
                    _heads_first(q[s.q_start : s.q_end]), _heads_first(k[s.q_start : s.q_end]),
                    _heads_first(v[s.q_start : s.q_end]), is_causal=True, scale=scale, enable_gqa=True,
                )
                out[s.q_start : s.q_end] = o[0].transpose(0, 1)
                continue
            ks = _heads_first(keys[s.ctx_start : s.ctx_end])
            vs = _heads_first(values[s.ctx_start : s.ctx_end])
            if s.q_end - s.q_start == 1:
                qs = q[s.q_start].view(1, num_kv, group, head_dim)
                o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
                out[s.q_start] = o.view(-1, head_dim)
            else:
                o = F.scaled_dot_product_attention(
                    _heads_first(q[s.q_start : s.q_end]), ks, vs, attn_mask=s.mask, scale=scale, enable_gqa=True
                )
                out[s.q_start : s.q_end] = o[0].transpose(0, 1)
        return out


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D]
