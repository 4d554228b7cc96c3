"""Reference attention in plain torch (CPU and CUDA).

Decode-shaped sequences are batched: their pages are gathered into one padded
[B, max_pages * page_size] key range and masked past each context length. Prefill-shaped
sequences run one SDPA each: causal over the new tokens when nothing is cached, or with an
explicit mask when the query starts after a cached prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, BatchLayout, write_kv


@dataclass(slots=True)
class _PrefillSeq:
    start: int
    end: int
    context_len: int
    pages: torch.Tensor | None  # None: no cached prefix, attend over the new K/V directly
    mask: torch.Tensor | None  # [q_len, context_len] bool, when a cached prefix exists


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, layout: BatchLayout) -> None:
        self.layout = layout
        dev, ps, nd = layout.device, layout.page_size, layout.num_decodes
        self.decode_pages = self.decode_mask = None
        self.decode_ctx = None  # one decode: slice keys to its exact length instead of masking
        if nd:
            max_pages = max(-(-layout.context_lens[i] // ps) for i in range(nd))
            table = [bt[:max_pages] + [0] * (max_pages - min(len(bt), max_pages)) for bt in layout.block_tables[:nd]]
            self.decode_pages = torch.tensor(table, dtype=torch.long, device=dev)
            if nd == 1:
                self.decode_ctx = layout.context_lens[0]
            elif any(c != max_pages * ps for c in layout.context_lens[:nd]):
                ctx = torch.tensor(layout.context_lens[:nd], device=dev)
                self.decode_mask = (torch.arange(max_pages * ps, device=dev)[None, :] < ctx[:, None])[:, None, None, :]
        self.prefills: list[_PrefillSeq] = []
        start = nd
        for i in range(nd, layout.num_seqs):
            q_len, ctx = layout.query_lens[i], layout.context_lens[i]
            end = start + q_len
            if ctx == q_len:
                self.prefills.append(_PrefillSeq(start, end, ctx, None, None))
            else:
                n_pages = -(-ctx // ps)
                pages = torch.tensor(layout.block_tables[i][:n_pages], dtype=torch.long, device=dev)
                q_pos = torch.arange(ctx - q_len, ctx, device=dev)
                mask = torch.arange(ctx, device=dev)[None, :] <= q_pos[:, None]
                self.prefills.append(_PrefillSeq(start, end, ctx, pages, mask))
            start = end

    def forward(self, layer, q, k, v, kv_cache):
        layout = self.layout
        write_kv(kv_cache, layout.slot_mapping, k, v)
        scale = self.spec.scale
        nd = layout.num_decodes
        if not self.prefills:
            return self._decode(q, kv_cache, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, scale)
        for seq in self.prefills:
            qs = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if seq.pages is None:
                ks = k[seq.start : seq.end]
                vs = v[seq.start : seq.end]
                o = F.scaled_dot_product_attention(
                    qs, _heads_first(ks), _heads_first(vs), is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                kv = kv_cache[seq.pages]  # [P, 2, ps, H, D]
                ks = kv[:, 0].flatten(0, 1)[: seq.context_len]
                vs = kv[:, 1].flatten(0, 1)[: seq.context_len]
                o = F.scaled_dot_product_attention(
                    qs, _heads_first(ks), _heads_first(vs), attn_mask=seq.mask, scale=scale, enable_gqa=True
                )
            out[seq.start : seq.end] = o[0].transpose(0, 1)
        return out

    def _decode(self, q, kv_cache, scale):
        kv = kv_cache[self.decode_pages]  # [B, P, 2, ps, H, D]
        b = kv.shape[0]
        keys = kv[:, :, 0].flatten(1, 2)  # [B, P*ps, H, D]
        values = kv[:, :, 1].flatten(1, 2)
        if self.decode_ctx is not None:
            keys, values = keys[:, : self.decode_ctx], values[:, : self.decode_ctx]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, Hq, 1, D]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=self.decode_mask,
            scale=scale,
            enable_gqa=True,
        )
        return o.view(b, q.shape[1], q.shape[2])


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D]
