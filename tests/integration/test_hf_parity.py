"""Greedy output equals Hugging Face transformers token for token, for every architecture,
page size (1, 16, and 7 which divides none of the prompt lengths), both CPU attention backends
(the compiled kernel and the torch reference), and with chunked prefill."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.attention import cpu_ext
from tests.conftest import ARCHS
from tests.helpers import hf_greedy, random_prompts

LENGTHS = (1, 5, 17, 40, 100, 300, 33, 64, 129)
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def reference(tiny_model):
    cache = {}

    def get(arch):
        if arch not in cache:
            model_dir = tiny_model(arch)
            from engine.config import ModelConfig

            vocab = ModelConfig.from_pretrained(model_dir).vocab_size
            prompts = random_prompts(LENGTHS, vocab, seed=1)
            cache[arch] = (model_dir, prompts, hf_greedy(model_dir, prompts, NEW_TOKENS))
        return cache[arch]

    return get


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("page_size", [1, 16, 7])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, page_size, backend, reference, make_llm):
    if backend == "cpu" and not cpu_ext.available():
        pytest.skip(f"no CPU kernel on this machine: {cpu_ext.unavailable_reason()}")  # only without a compiler (unit test)
    model_dir, prompts, expected = reference(arch)
    llm = make_llm(model_dir, page_size=page_size, attention_backend=backend)
    assert llm.runner.attn.name == backend
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens diverges"
        assert out.finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_mixed_with_decodes_matches_transformers(arch, reference, make_llm):
    # A 48-token budget splits the long prompts into chunks that share steps with decodes.
    model_dir, prompts, expected = reference(arch)
    llm = make_llm(model_dir, page_size=16, max_num_batched_tokens=48, max_num_seqs=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
