"""FlashInfer attention over the shared NHD paged KV cache (CUDA only; flashinfer imported lazily).

Per step, `plan` builds FlashInfer's page table once from the `BatchLayout` (CSR form:
`kv_indptr` [B+1] page offsets, `kv_indices` page ids, `kv_last_page_len` [B] tokens in each
last page, `qo_indptr` [B+1] query offsets) with numpy, and plans up to two wrappers that
share one workspace buffer:

* a decode wrapper for the decode-shaped head of the batch (`[0, num_decodes)`), which uses
  tensor cores (FlashInfer's prefill kernels driven by the decode scheduler) when the GQA group
  is 4 or more, FlashInfer's own advice, and CUDA-core decode kernels otherwise;
* a causal prefill wrapper for the prefill-shaped tail. FlashInfer aligns the causal mask to
  the end of each sequence's KV, so new tokens see the cached prefix and each other correctly.

Two wrappers, not one prefill wrapper for everything, because a decode pool runs pure-decode
steps almost all of its life: those then get the decode kernel and its split-KV schedule,
tuned for one query row against a long context, and only mixed steps pay for two launches.

The index arrays are handed to `plan` as host tensors: FlashInfer reads them on the host to
schedule and copies each to the device exactly once (a device tensor would cost a sync).
K/V are written with `base.write_kv` (the same scatter the torch backend uses), so both
backends leave byte-identical caches and no FlashInfer append API (whose signature changed
across versions) is needed.

FlashInfer versions: written against 0.2.x-0.3.x (checked against 0.3.1 sources), with later
releases in mind. Differences handled: `plan`'s 7th/8th argument is `head_dim` in early 0.2 and
`head_dim_qk` later (passed positionally); `non_blocking` defaults to False in 0.2 and True later;
keyword arguments (`use_tensor_cores`, `backend`, `out`, dtypes) are passed only when the
installed signature has them (`_supported_kwargs`).
"""
from __future__ import annotations

import inspect
from itertools import chain
from typing import Any, Callable

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionSpec, BatchLayout, write_kv

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 * 1024 * 1024
PREFILL_BACKENDS = ("auto", "fa2", "fa3")
TENSOR_CORE_DECODE_MIN_GROUP = 4


def _supported_kwargs(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """Keep only the keyword arguments `fn` accepts, so one call works across FlashInfer versions."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, spec: AttentionSpec, *, prefill_backend: str = "auto") -> None:
        super().__init__(spec)
        _validate(spec)
        if prefill_backend not in PREFILL_BACKENDS:
            raise ValueError(f"prefill_backend must be one of {list(PREFILL_BACKENDS)}, got {prefill_backend!r}")
        try:
            import flashinfer
        except ImportError as e:  # registry checks find_spec first; this covers a broken install
            raise ValueError(
                "attention_backend='flashinfer' needs the flashinfer-python package (pip install 'pdcluster[gpu]')"
            ) from e
        self._fi = flashinfer
        self.version = getattr(flashinfer, "__version__", "unknown")
        self.group_size = spec.num_q_heads // spec.num_kv_heads
        self.use_tensor_cores = self.group_size >= TENSOR_CORE_DECODE_MIN_GROUP
        # One workspace for both wrappers: they run one after the other on one stream.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)
        decode_cls = flashinfer.BatchDecodeWithPagedKVCacheWrapper
        prefill_cls = flashinfer.BatchPrefillWithPagedKVCacheWrapper
        self.decode_wrapper = decode_cls(
            self.workspace, "NHD", **_supported_kwargs(decode_cls.__init__, use_tensor_cores=self.use_tensor_cores)
        )
        prefill_kwargs = {} if prefill_backend == "auto" else {"backend": prefill_backend}
        self.prefill_wrapper = prefill_cls(self.workspace, "NHD", **_supported_kwargs(prefill_cls.__init__, **prefill_kwargs))
        self._decode_takes_out = "out" in inspect.signature(decode_cls.run).parameters
        self._prefill_takes_out = "out" in inspect.signature(prefill_cls.run).parameters
        self.num_decodes = 0
        self.has_prefill = False
        self.layout: BatchLayout | None = None

    # ---- per step ---------------------------------------------------------------------------
    def plan(self, layout: BatchLayout) -> None:
        s, ps = self.spec, layout.page_size
        if ps != s.page_size:
            raise ValueError(f"layout.page_size must equal the backend's page_size {s.page_size}, got {ps}")
        nd, n = layout.num_decodes, layout.num_seqs
        query_lens = np.asarray(layout.query_lens, dtype=np.int64)
        context_lens = np.asarray(layout.context_lens, dtype=np.int64)
        pages_per_seq = (context_lens + ps - 1) // ps
        if (context_lens < query_lens).any() or (query_lens[:nd] != 1).any() or (query_lens <= 0).any():
            raise ValueError("BatchLayout needs 1 <= query_len <= context_len, and query_len == 1 for decodes")
        kv_indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(pages_per_seq, out=kv_indptr[1:])
        kv_indices = np.fromiter(  # one C-level pass over page ids (pages, not tokens)
            chain.from_iterable(t[:k] for t, k in zip(layout.block_tables, pages_per_seq.tolist())),
            dtype=np.int32, count=int(kv_indptr[-1]),
        )
        last_page_len = (context_lens - 1) % ps + 1
        qo_indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qo_indptr[1:])

        common = dict(q_data_type=s.dtype, kv_data_type=s.dtype, sm_scale=s.scale, non_blocking=True)
        heads = (s.num_q_heads, s.num_kv_heads, s.head_dim, ps)
        if nd:
            w = self.decode_wrapper
            w.plan(
                _host(kv_indptr[: nd + 1]), _host(kv_indices[: kv_indptr[nd]]), _host(last_page_len[:nd]),
                *heads, **_supported_kwargs(w.plan, **common),
            )
        if nd < n:
            w, p0 = self.prefill_wrapper, int(kv_indptr[nd])
            w.plan(
                _host(qo_indptr[nd:] - qo_indptr[nd]), _host(kv_indptr[nd:] - p0), _host(kv_indices[p0:]),
                _host(last_page_len[nd:]), *heads, **_supported_kwargs(w.plan, causal=True, **common),
            )
        self.num_decodes, self.has_prefill = nd, nd < n
        self.layout = layout

    def forward(self, layer, q, k, v, kv_cache):
        layout = self.layout
        if layout is None:
            raise RuntimeError("FlashInferAttentionBackend.forward called before plan()")
        write_kv(kv_cache, layout.slot_mapping, k, v)
        nd = self.num_decodes  # decode rows are the first nd query tokens (one each)
        if not self.has_prefill:
            return self._run(self.decode_wrapper, self._decode_takes_out, q, kv_cache, None)
        if nd == 0:
            return self._run(self.prefill_wrapper, self._prefill_takes_out, q, kv_cache, None)
        out = torch.empty_like(q)
        self._run(self.decode_wrapper, self._decode_takes_out, q[:nd], kv_cache, out[:nd])
        self._run(self.prefill_wrapper, self._prefill_takes_out, q[nd:], kv_cache, out[nd:])
        return out

    @staticmethod
    def _run(wrapper, takes_out: bool, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None):
        q = q.contiguous()
        if out is None:
            return wrapper.run(q, kv_cache)
        if takes_out:
            wrapper.run(q, kv_cache, out=out)
        else:
            out.copy_(wrapper.run(q, kv_cache))
        return out


def _host(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


def _validate(spec: AttentionSpec) -> None:
    if spec.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"FlashInfer attention supports dtype in {[str(d) for d in SUPPORTED_DTYPES]}, got {spec.dtype} "
            "(use attention_backend='torch' for float32)"
        )
    if torch.device(spec.device).type != "cuda":
        raise ValueError(f"FlashInfer attention needs a CUDA device, got {spec.device}")
    if spec.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"FlashInfer attention supports head_dim in {list(SUPPORTED_HEAD_DIMS)}, got {spec.head_dim}")
    if spec.num_kv_heads <= 0 or spec.num_q_heads % spec.num_kv_heads:
        raise ValueError(
            f"num_q_heads ({spec.num_q_heads}) must be a positive multiple of num_kv_heads ({spec.num_kv_heads})"
        )
