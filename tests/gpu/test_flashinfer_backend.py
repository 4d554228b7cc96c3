"""FlashInfer backend against the torch reference, on a CUDA device with flashinfer installed.

Backend level: identical random paged caches and batches (cached prefixes in scattered pages,
decode + prefill mixes, page sizes 1/16/32, GQA groups 1/3/8, bf16 and fp16) give outputs
within the dtype's tolerance of `TorchAttentionBackend`, and byte-identical caches.

Engine level: `LLM(..., attention_backend="flashinfer")` and `"torch"` give the same greedy
tokens. The one divergence allowed: a sequence may part ways at a position where a float32
Hugging Face forward of the common prefix puts its top-2 logits within bf16 noise
(`BF16_TIE_MARGIN` relative to the top logit); the candidate is then put back on the
reference's token and compared again from there. Any other difference fails.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (FlashInfer kernels are CUDA only)", allow_module_level=True)
flashinfer = pytest.importorskip(
    "flashinfer", reason="flashinfer-python is not installed (optional gpu extra: pip install 'pdcluster[gpu]')"
)

from engine.attention import AttentionSpec, create_backend  # noqa: E402
from engine.attention.flashinfer_backend import SUPPORTED_HEAD_DIMS, FlashInferAttentionBackend  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
BF16_TIE_MARGIN = 4 * 2**-8  # four bf16 ulps of the top logit

SHAPES = {
    # (cached_len, query_len): decodes first, then prefills with and without a cached prefix
    "decode": [(0, 1), (1, 1), (15, 1), (16, 1), (31, 1), (200, 1), (1023, 1)],
    "prefill": [(0, 1 + 16), (0, 33), (17, 5), (64, 64), (250, 7), (0, 300)],
    "mixed": [(5, 1), (47, 1), (511, 1), (0, 31), (32, 16), (100, 129), (13, 2)],
}
HEADS = [(8, 8), (12, 4), (16, 2)]  # GQA groups 1 (CUDA-core decode), 3 (bench model), 8 (tensor-core decode)


def _spec(hq, hkv, d, ps, dtype):
    return AttentionSpec(hq, hkv, d, ps, dtype, CUDA, d**-0.5)


def _compare(batch, spec, layers=2):
    ref, fi = create_backend("torch", spec), create_backend("flashinfer", spec)
    assert isinstance(fi, FlashInferAttentionBackend)
    ref.plan(batch.layout)
    fi.plan(batch.layout)
    for layer in range(layers):  # one plan serves every layer, each with its own cache
        cache = batch.kv_cache.roll(layer, dims=0).contiguous()
        cache_ref, cache_fi = cache.clone(), cache.clone()
        q, k, v = (x * (1 + layer) for x in (batch.q, batch.k, batch.v))
        out_ref = ref.forward(layer, q, k, v, cache_ref)
        out_fi = fi.forward(layer, q, k, v, cache_fi)
        assert out_fi.shape == q.shape and out_fi.dtype == q.dtype
        torch.testing.assert_close(out_fi.float(), out_ref.float(), atol=TOL[spec.dtype], rtol=TOL[spec.dtype])
        assert torch.equal(cache_fi, cache_ref), "the KV written by forward differs between backends"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("page_size", [1, 16, 32])
def test_matches_torch_backend_bf16(make_paged_batch, shape, heads, page_size):
    hq, hkv = heads
    batch = make_paged_batch(SHAPES[shape], page_size=page_size, num_q_heads=hq, num_kv_heads=hkv,
                             head_dim=128, dtype=torch.bfloat16, device=CUDA, seed=page_size + hq)
    _compare(batch, _spec(hq, hkv, 128, page_size, torch.bfloat16))


@pytest.mark.parametrize("shape", ["decode", "mixed"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
def test_matches_torch_backend_fp16(make_paged_batch, shape, heads):
    hq, hkv = heads
    batch = make_paged_batch(SHAPES[shape], page_size=16, num_q_heads=hq, num_kv_heads=hkv,
                             head_dim=128, dtype=torch.float16, device=CUDA, seed=hq)
    _compare(batch, _spec(hq, hkv, 128, 16, torch.float16))


@pytest.mark.parametrize("shape", ["decode", "mixed"])
def test_matches_torch_backend_head_dim_64(make_paged_batch, shape):
    # head_dim 64, GQA 3: the shape of the built-in bench model
    batch = make_paged_batch(SHAPES[shape], page_size=16, num_q_heads=12, num_kv_heads=4,
                             head_dim=64, dtype=torch.bfloat16, device=CUDA, seed=64)
    _compare(batch, _spec(12, 4, 64, 16, torch.bfloat16))


def test_rejects_unsupported_dtype_and_head_dim():
    with pytest.raises(ValueError, match="float32"):
        FlashInferAttentionBackend(_spec(8, 8, 128, 16, torch.float32))
    with pytest.raises(ValueError, match="head_dim"):
        FlashInferAttentionBackend(_spec(8, 8, 32, 16, torch.bfloat16))


# ---- engine level ---------------------------------------------------------------------------
def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(3, vocab_size, (n,), generator=gen).tolist()

    shared = ids(48)  # three full pages: the later prompts hit the prefix cache
    return [ids(3), ids(17), ids(160), shared + ids(9), shared + ids(40), ids(600), shared + ids(1)]


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _top2_margin(model, ids: list[int]) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1]), float(top[0].abs())


def assert_same_greedy_up_to_ties(reference, candidate, hf, prompts, max_tokens: int) -> list[tuple[int, int]]:
    """Every token `candidate` picks differently from `reference` sits at a float32 near-tie.

    `reference` and `candidate` are LLMs. Where a sequence parts ways, the float32 Hugging Face
    model `hf` must put its top-2 logits for that position within `BF16_TIE_MARGIN`; the
    candidate is then forced onto the reference's token (prompt + reference tokens so far) and
    compared again from there, so the whole reference trajectory is checked, not only up to the
    first tie. Returns the (sequence, position) of every divergence."""
    from engine import SamplingParams

    def greedy(llm, prompt_list, n):
        return [o.token_ids for o in llm.generate(prompt_list, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]

    ref = greedy(reference, prompts, max_tokens)
    cand = greedy(candidate, prompts, max_tokens)
    divergences = []
    for i, prompt in enumerate(prompts):
        pos, got = 0, cand[i]
        while (d := _first_divergence(ref[i][pos:], got)) is not None:
            at = pos + d
            margin, top = _top2_margin(hf, list(prompt) + ref[i][:at])
            assert margin <= BF16_TIE_MARGIN * max(1.0, top), (
                f"prompt {i} diverges at generated token {at} where the float32 top-2 logits are {margin:.4f} apart "
                f"(tie threshold {BF16_TIE_MARGIN * max(1.0, top):.4f}): reference {ref[i]} vs candidate "
                f"{ref[i][:pos] + got}"
            )
            divergences.append((i, at))
            pos = at + 1
            if pos >= max_tokens:
                break
            got = greedy(candidate, [list(prompt) + ref[i][:pos]], max_tokens - pos)[0]
    return divergences


@pytest.mark.parametrize("arch,preset", [("llama", "tiny"), ("qwen3", "tiny"), ("llama", "bench")])
def test_llm_greedy_tokens_match_torch_backend(arch, preset):
    """On an H200 the bench model diverges in 5 of 7 prompts, each at a certified
    near-tie: its random weights put 23 % of greedy positions within the tie margin (measured in
    float32 on CPU), so a bound on how many sequences may diverge is no test there. Forcing the
    candidate back onto the reference after each tie checks every position instead."""
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from engine.builtin import ensure_builtin, model_spec

    if model_spec(arch, preset).head_dim not in SUPPORTED_HEAD_DIMS:
        pytest.skip(f"{arch}-{preset} has head_dim {model_spec(arch, preset).head_dim}; "
                    f"FlashInfer kernels support {list(SUPPORTED_HEAD_DIMS)}")
    model_dir = ensure_builtin(arch, preset)
    # a small token budget forces chunked prefills and decode+prefill mixed steps
    llms = {b: LLM(model_dir, dtype="bfloat16", device="cuda", attention_backend=b, max_num_batched_tokens=256)
            for b in ("torch", "flashinfer")}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(CUDA).eval()
    prompts = _prompts(llms["torch"].config.vocab_size)
    assert_same_greedy_up_to_ties(llms["torch"], llms["flashinfer"], hf, prompts, max_tokens=24)
    assert_same_greedy_up_to_ties(llms["flashinfer"], llms["torch"], hf, prompts, max_tokens=24)
