"""Turns a ScheduledBatch into tensors, runs the model over the paged KV cache, and samples.

Owns the weights, the per-layer KV cache tensors and the attention backend. Knows nothing of
queues or policies: the scheduler decides what runs, the runner only runs it.

Under tensor parallelism (engine/parallel.py) every rank has a runner over its shard and its
KV heads. The leader's `execute` sends each step's host-side inputs to the followers before
its own forward; a follower's loop (engine/tp_worker.py) calls `follower_step` with them.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.attention import AttentionSpec, BatchLayout, create_backend
from engine.config import ModelConfig
from engine.loader import load_model
from engine.parallel import StepInputs, TPGroup, TPShard
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler import ScheduledBatch


def allocate_kv_caches(cfg: ModelConfig, num_pages: int, page_size: int, dtype, device,
                       num_kv_heads: int | None = None) -> list[torch.Tensor]:
    """One cache tensor per layer; `num_kv_heads`: a tensor-parallel rank's own KV heads."""
    shape = (num_pages, 2, page_size, num_kv_heads or cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes one page takes across all layers (K and V), on one rank of a tensor-parallel group."""
    kv_heads = TPShard.of(cfg, 0, tensor_parallel_size).num_kv_heads
    return 2 * cfg.num_layers * kv_heads * cfg.head_dim * page_size * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model_dir, cfg: ModelConfig, *, dtype, device, page_size: int, num_pages: int,
                 max_model_len: int, attention_backend: str, tp: TPGroup | None = None,
                 vocab_parallel: bool = False) -> None:
        """`tp`: this rank's group; `vocab_parallel`: the LM head's rows split over the ranks
        (engine/parallel.py), else every rank holds all of it and only the leader uses it."""
        self.cfg, self.dtype, self.device, self.page_size = cfg, dtype, device, page_size
        self.tp = tp
        self.shard = shard = (TPShard.of(cfg, tp.rank, tp.world, vocab_parallel) if tp is not None
                              else TPShard.of(cfg))
        self.model = load_model(model_dir, cfg, dtype, device, max_positions=max_model_len, shard=shard,
                                all_reduce=tp.all_reduce if tp is not None else None)
        self.kv_caches = allocate_kv_caches(cfg, num_pages, page_size, dtype, device, shard.num_kv_heads)
        spec = AttentionSpec(shard.num_heads, shard.num_kv_heads, cfg.head_dim, page_size, dtype, device,
                             cfg.head_dim**-0.5)
        self.attn = create_backend(attention_backend, spec)
        self.sampler = Sampler()

    def layout(self, s: StepInputs) -> tuple[torch.Tensor, torch.Tensor, BatchLayout]:
        """Device tensors and the attention layout of one step's host-side inputs."""
        dev = self.device
        qsl = np.zeros(len(s.query_lens) + 1, dtype=np.int32)
        np.cumsum(s.query_lens, out=qsl[1:])
        layout = BatchLayout(
            page_size=self.page_size,
            query_lens=list(s.query_lens),
            context_lens=list(s.context_lens),
            block_tables=s.block_tables,
            num_decodes=s.num_decodes,
            slot_mapping=torch.from_numpy(np.ascontiguousarray(s.slot_mapping)).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            device=dev,
        )
        input_ids = torch.from_numpy(np.ascontiguousarray(s.input_ids, dtype=np.int64)).to(dev)
        return input_ids, torch.from_numpy(np.ascontiguousarray(s.positions)).to(dev), layout

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, list[int], list[Request]]:
        """The step's host-side inputs, and which rows sample for which requests."""
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
        inputs = StepInputs(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=np.concatenate(positions),
            slot_mapping=np.concatenate(slots),
            query_lens=list(batch.num_new_tokens),
            context_lens=context_lens,
            block_tables=[req.pages for req in batch.requests],
            num_decodes=batch.num_decodes,
            sample_rows=sample_rows,
        )
        return inputs, sample_rows, sample_reqs

    @torch.inference_mode()
    def forward_step(self, inputs: StepInputs, on_layer=None, final_norm: bool = True) -> torch.Tensor:
        """This rank's forward over one step's inputs (writes its KV heads into its cache)."""
        input_ids, positions, layout = self.layout(inputs)
        self.attn.plan(layout)
        return self.model(input_ids, positions, self.attn, self.kv_caches, on_layer, final_norm=final_norm)

    @torch.inference_mode()
    def follower_step(self, inputs: StepInputs, on_layer=None) -> None:
        """A follower's part of one step: its shard's forward (`on_layer(i)` once layer i's K/V
        are written, as on the leader) and, with a vocab-parallel LM head, its slice of the
        sampled rows' logits, gathered by the leader."""
        if not self.shard.vocab_parallel:
            self.forward_step(inputs, on_layer, final_norm=False)
            return
        hidden = self.forward_step(inputs, on_layer)
        if inputs.sample_rows:
            self.tp.gather_logits(self.model.compute_logits(hidden[inputs.sample_rows]))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, on_layer=None) -> dict[Request, tuple[int, object]]:
        """Run one step; returns the sampled (token id, logprobs) for each request that samples.
        `on_layer(i)` is called once layer i's K/V for this step are written. The leader of a
        tensor-parallel group first hands the step to its followers."""
        inputs, sample_rows, reqs = self.prepare(batch)
        if self.tp is not None:
            self.tp.send_step(inputs)
            try:
                hidden = self.forward_step(inputs, on_layer)
                if reqs:
                    logits = self.model.compute_logits(hidden[sample_rows])
                    if self.shard.vocab_parallel:
                        logits = self.tp.gather_logits(logits)
            except BaseException as exc:  # the followers may be mid-step: the group is out of step
                self.tp.mark_broken(f"the leader's forward failed: {type(exc).__name__}: {exc}")
                raise
        else:
            hidden = self.forward_step(inputs, on_layer)
            if reqs:
                logits = self.model.compute_logits(hidden[sample_rows])
        if not reqs:
            return {}
        out = self.sampler(logits, [r.params for r in reqs], [r.seed for r in reqs], [r.num_tokens for r in reqs])
        return {req: (tok, lp) for req, tok, lp in zip(reqs, out.token_ids, out.logprobs)}
