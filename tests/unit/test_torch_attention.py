"""The torch reference attention against a dense float64 softmax, on paged caches.

Decode-shaped sequences are batched by context length into padded, masked SDPA calls; these
cases put lengths inside one bucket, across bucket edges, at 1, and mixed with prefills (with
and without a cached prefix), so a wrong pad, mask or row order shows up as a wrong output.
"""
from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionSpec, create_backend
from engine.attention.torch_backend import BUCKET_RATIO, CPU_GATHER_BYTES
from tests.helpers import random_paged_batch

CASES = {
    "one_bucket_equal": [(99, 1)] * 5,
    "spread": [(0, 1), (1, 1), (14, 1), (15, 1), (16, 1), (100, 1), (123, 1), (124, 1), (125, 1), (700, 1), (2047, 1)],
    "mixed": [(300, 1), (5, 1), (47, 1), (299, 1), (0, 31), (32, 16), (100, 129), (13, 2)],
    "prefill_only": [(0, 40), (64, 9)],
}


def _dense_reference(batch, spec, cache):
    """Per sequence: its K/V read back page by page from the written cache, causal softmax in float64."""
    lay, out, q_start = batch.layout, [], 0
    group = spec.num_q_heads // spec.num_kv_heads
    for q_len, ctx, table in zip(lay.query_lens, lay.context_lens, lay.block_tables):
        pages = cache[torch.tensor(table[: -(-ctx // lay.page_size)])]  # [P, 2, ps, H, D]
        k = pages[:, 0].reshape(-1, spec.num_kv_heads, spec.head_dim)[:ctx].double().repeat_interleave(group, 1)
        v = pages[:, 1].reshape(-1, spec.num_kv_heads, spec.head_dim)[:ctx].double().repeat_interleave(group, 1)
        q = batch.q[q_start : q_start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        q_start += q_len
    return torch.cat(out)


def _backend(name, spec):
    """'cpu-portable': the CPU kernel's plain-C loop, which x86 machines with AVX2 otherwise skip."""
    backend = create_backend(name.removesuffix("-portable"), spec)
    if name.endswith("-portable"):
        backend.portable = True
    return backend


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend_name", ["torch", "cpu", "cpu-portable"])
def test_paged_attention_matches_dense_softmax(case, page_size, backend_name):
    hq, hkv, d = 8, 4, 32
    spec = AttentionSpec(hq, hkv, d, page_size, torch.float32, torch.device("cpu"), d**-0.5)
    batch = random_paged_batch(CASES[case], page_size=page_size, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                               dtype=torch.float32, device=torch.device("cpu"))
    backend = _backend(backend_name, spec)
    backend.plan(batch.layout)
    cache = batch.kv_cache.clone()
    out = backend.forward(0, batch.q, batch.k, batch.v, cache)
    torch.testing.assert_close(out.double(), _dense_reference(batch, spec, cache), atol=1e-5, rtol=1e-5)


def test_decodes_of_similar_length_share_one_call_and_spread_lengths_do_not():
    spec = AttentionSpec(8, 4, 32, 16, torch.float32, torch.device("cpu"), 32**-0.5)
    batch = random_paged_batch(CASES["spread"], page_size=16, num_q_heads=8, num_kv_heads=4, head_dim=32,
                               dtype=torch.float32, device=torch.device("cpu"))
    backend = create_backend("torch", spec)
    backend.plan(batch.layout)
    lengths = [[batch.layout.context_lens[i] for i in b.q_rows.tolist()] for b in backend.buckets]
    assert sorted(x for b in lengths for x in b) == sorted(batch.layout.context_lens)
    assert all(max(b) <= BUCKET_RATIO * min(b) for b in lengths)
    assert lengths == [[1], [2], [15, 16, 17], [101, 124, 125, 126], [701], [2048]]


def test_a_cpu_bucket_is_cut_at_the_gather_budget_and_still_matches():
    """Twelve decodes of 99-121 tokens fit one bucket by length; with a budget of 250 tokens of
    K and V each call holds two of them, and the output is what the single call gives."""
    spec = AttentionSpec(8, 4, 32, 16, torch.float32, torch.device("cpu"), 32**-0.5)
    seqs = [(98 + 2 * i, 1) for i in range(12)]
    batch = random_paged_batch(seqs, page_size=16, num_q_heads=8, num_kv_heads=4, head_dim=32,
                               dtype=torch.float32, device=torch.device("cpu"))
    whole = create_backend("torch", spec)
    assert whole.gather_bytes == CPU_GATHER_BYTES  # the default on a CPU
    whole.plan(batch.layout)
    assert len(whole.buckets) == 1
    out_whole = whole.forward(0, batch.q, batch.k, batch.v, batch.kv_cache.clone())

    token_bytes = 2 * 4 * 32 * 4
    cut = create_backend("torch", spec)
    cut.gather_bytes = 250 * token_bytes  # two sequences of ~110 tokens per call
    cut.plan(batch.layout)
    sizes = [b.q_rows.numel() for b in cut.buckets]
    assert sizes == [2] * 6
    assert all(b.q_rows.numel() * b.max_len * token_bytes <= 250 * token_bytes for b in cut.buckets)
    cache = batch.kv_cache.clone()
    out_cut = cut.forward(0, batch.q, batch.k, batch.v, cache)
    torch.testing.assert_close(out_cut, out_whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_cut.double(), _dense_reference(batch, spec, cache), atol=1e-5, rtol=1e-5)


def test_the_cpu_kernel_builds_where_there_is_a_compiler():
    """`auto` falls back to the torch backend when the kernel cannot be built; a build that breaks
    on a machine with a compiler must fail here rather than silently slow every CPU engine."""
    import shutil

    from engine.attention import cpu_ext, resolve_backend_name

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler here; the fallback is checked by the next test")
    assert cpu_ext.available(), cpu_ext.unavailable_reason()
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"


def test_without_a_compiler_or_a_built_kernel_auto_is_the_torch_backend(monkeypatch, tmp_path, caplog):
    from engine.attention import cpu_ext, resolve_backend_name

    monkeypatch.setattr(cpu_ext, "_module", None)
    monkeypatch.setattr(cpu_ext, "_error", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built here
    monkeypatch.setenv("PATH", str(tmp_path))  # and no compiler
    assert not cpu_ext.available()
    assert "no C++ compiler" in cpu_ext.unavailable_reason()
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        create_backend("cpu", AttentionSpec(8, 4, 32, 16, torch.float32, torch.device("cpu"), 32**-0.5))
    assert "uses the torch backend" in caplog.text


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_in_half_precision_matches_dense_softmax(dtype, portable):
    """The kernel reads 16-bit caches and accumulates in float32: within the output dtype's rounding."""
    hq, hkv, d = 8, 2, 64
    spec = AttentionSpec(hq, hkv, d, 16, dtype, torch.device("cpu"), d**-0.5)
    batch = random_paged_batch(CASES["mixed"], page_size=16, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                               dtype=dtype, device=torch.device("cpu"))
    backend = create_backend("cpu", spec)
    backend.portable = portable
    backend.plan(batch.layout)
    cache = batch.kv_cache.clone()
    out = backend.forward(0, batch.q, batch.k, batch.v, cache)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), _dense_reference(batch, spec, cache), atol=2e-2, rtol=2e-2)


def test_cpu_backend_takes_decodes_wherever_they_sit_in_the_batch():
    """A one-token prompt is decode-shaped but is scheduled after the prefills: the kernel's rows
    are gathered, not assumed to be the batch's first ones."""
    import dataclasses

    hq, hkv, d = 8, 4, 32
    spec = AttentionSpec(hq, hkv, d, 16, torch.float32, torch.device("cpu"), d**-0.5)
    made = random_paged_batch([(40, 1), (0, 1), (0, 20)], page_size=16, num_q_heads=hq, num_kv_heads=hkv,
                              head_dim=d, dtype=torch.float32, device=torch.device("cpu"))
    lay = made.layout
    order, rows = [0, 2, 1], torch.tensor([0, *range(2, 22), 1])  # move the one-token prompt last
    layout = dataclasses.replace(
        lay, query_lens=[lay.query_lens[i] for i in order], context_lens=[lay.context_lens[i] for i in order],
        block_tables=[lay.block_tables[i] for i in order], num_decodes=1, slot_mapping=lay.slot_mapping[rows],
    )
    batch = dataclasses.replace(made, layout=layout, q=made.q[rows], k=made.k[rows], v=made.v[rows])
    backend = create_backend("cpu", spec)
    backend.plan(batch.layout)
    assert backend.decodes[0].tolist() == [0, 21]
    cache = batch.kv_cache.clone()
    out = backend.forward(0, batch.q, batch.k, batch.v, cache)
    torch.testing.assert_close(out.double(), _dense_reference(batch, spec, cache), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq, hkv, d", [(12, 4, 64), (6, 6, 128), (5, 1, 40), (16, 2, 16)])
def test_cpu_kernel_head_shapes(hq, hkv, d):
    """Query heads not a multiple of eight (the AVX2 loop pads them), MHA, head sizes it does not
    take (40: the plain loop), and a wide group."""
    spec = AttentionSpec(hq, hkv, d, 16, torch.float32, torch.device("cpu"), d**-0.5)
    batch = random_paged_batch(CASES["spread"], page_size=16, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                               dtype=torch.float32, device=torch.device("cpu"))
    backend = create_backend("cpu", spec)
    backend.plan(batch.layout)
    cache = batch.kv_cache.clone()
    out = backend.forward(0, batch.q, batch.k, batch.v, cache)
    torch.testing.assert_close(out.double(), _dense_reference(batch, spec, cache), atol=1e-5, rtol=1e-5)


def test_cpu_kernel_refuses_tables_that_would_read_outside_the_cache():
    from engine.attention import cpu_ext

    cache = torch.zeros(4, 2, 16, 2, 32)
    q, out = torch.zeros(1, 4, 32), torch.zeros(1, 4, 32)
    with pytest.raises(RuntimeError, match="block_tables"):
        cpu_ext.paged_decode_attention(out, q, cache, torch.tensor([[4]], dtype=torch.int32),
                                       torch.tensor([3], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="context_lens"):
        cpu_ext.paged_decode_attention(out, q, cache, torch.tensor([[0]], dtype=torch.int32),
                                       torch.tensor([17], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_ext.paged_decode_attention(out, q, cache.bfloat16(), torch.tensor([[0]], dtype=torch.int32),
                                       torch.tensor([3], dtype=torch.int32), 0.1)
