"""Turns a ScheduledBatch into tensors, runs the model over the paged KV cache, and samples.

Owns the weights, the per-layer KV cache tensors and the attention backend. Knows nothing of
queues or policies: the scheduler decides what runs, the runner only runs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionSpec, BatchLayout, create_backend
from engine.config import ModelConfig
from engine.loader import load_model
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler import ScheduledBatch


def allocate_kv_caches(cfg: ModelConfig, num_pages: int, page_size: int, dtype, device) -> list[torch.Tensor]:
    shape = (num_pages, 2, page_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page takes across all layers (K and V)."""
    return cfg.kv_bytes_per_token * page_size * torch.empty((), dtype=dtype).element_size()


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    layout: BatchLayout
    sample_rows: list[int]  # row in the flat batch whose logits are sampled
    sample_requests: list[Request]


class ModelRunner:
    def __init__(self, model_dir, cfg: ModelConfig, *, dtype, device, page_size: int, num_pages: int,
                 max_model_len: int, attention_backend: str) -> None:
        self.cfg, self.dtype, self.device, self.page_size = cfg, dtype, device, page_size
        self.model = load_model(model_dir, cfg, dtype, device, max_positions=max_model_len)
        self.kv_caches = allocate_kv_caches(cfg, num_pages, page_size, dtype, device)
        spec = AttentionSpec(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page_size, dtype, device, cfg.head_dim**-0.5)
        self.attn = create_backend(attention_backend, spec)
        self.sampler = Sampler()

    def prepare(self, batch: ScheduledBatch) -> StepTensors:
        ps = self.page_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        context_lens, sample_rows, sample_reqs = [], [], []
        row = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start : start + n])
            pos = np.arange(start, start + n, dtype=np.int64)
            pages = np.asarray(req.pages, dtype=np.int64)
            positions.append(pos)
            slots.append(pages[pos // ps] * ps + pos % ps)
            context_lens.append(start + n)
            row += n
            if start + n == req.num_tokens:  # reached the end of known tokens: sample the next
                sample_rows.append(row - 1)
                sample_reqs.append(req)
        dev = self.device
        qsl = np.zeros(len(batch.requests) + 1, dtype=np.int32)
        np.cumsum(batch.num_new_tokens, out=qsl[1:])
        layout = BatchLayout(
            page_size=ps,
            query_lens=list(batch.num_new_tokens),
            context_lens=context_lens,
            block_tables=[req.pages for req in batch.requests],
            num_decodes=batch.num_decodes,
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            device=dev,
        )
        return StepTensors(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            layout=layout,
            sample_rows=sample_rows,
            sample_requests=sample_reqs,
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, on_layer=None) -> dict[Request, tuple[int, object]]:
        """Run one step; returns the sampled (token id, logprobs) for each request that samples.
        `on_layer(i)` is called once layer i's K/V for this step are written."""
        t = self.prepare(batch)
        self.attn.plan(t.layout)
        hidden = self.model(t.input_ids, t.positions, self.attn, self.kv_caches, on_layer)
        if not t.sample_requests:
            return {}
        logits = self.model.compute_logits(hidden[t.sample_rows])
        reqs = t.sample_requests
        out = self.sampler(logits, [r.params for r in reqs], [r.seed for r in reqs], [r.num_tokens for r in reqs])
        return {req: (tok, lp) for req, tok, lp in zip(t.sample_requests, out.token_ids, out.logprobs)}
