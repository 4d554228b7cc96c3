"""Tensor parallelism on CUDA (engine/parallel.py's NCCL path): `LLM(tiny, tensor_parallel_size=2,
device="cuda")` on two GPUs gives transformers' greedy tokens (float32, the torch attention
backend), under the near-tie rule of tests/integration/test_tensor_parallel.py: a sequence may
part from transformers only where transformers' top-2 logits are less than 1e-4 apart.
Skipped without two CUDA devices."""
from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices (tensor parallelism over NCCL)", allow_module_level=True)

from engine import LLM, SamplingParams  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from tests.helpers import _hf_model, hf_greedy, random_prompts  # noqa: E402

pytestmark = pytest.mark.gpu
TIE_GAP = 1e-4
NEW_TOKENS = 32


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_on_two_gpus_matches_transformers(arch, tiny_model):
    model_dir = tiny_model(arch)
    prompts = random_prompts((1, 5, 17, 40, 100), ModelConfig.from_pretrained(model_dir).vocab_size, seed=3)
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    llm = LLM(model_dir, tensor_parallel_size=2, device="cuda", dtype="float32", attention_backend="torch")
    pids = llm.tensor_parallel_pids
    try:
        assert llm.device == torch.device("cuda:0")
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        ties = 0
        for prompt, out, ref in zip(prompts, outs, expected):
            assert out.finish_reason == "length", out.error
            k = next((j for j, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), None)
            if k is None:
                continue
            with torch.no_grad():
                logits = _hf_model(str(model_dir))(torch.tensor([prompt + ref[:k]])).logits[0, -1]
            top = torch.topk(logits, 2).values
            assert float(top[0] - top[1]) < TIE_GAP, f"prompt of {len(prompt)} tokens diverges at token {k}"
            ties += 1
        print(f"\nTP=2 {arch} on CUDA: {ties} of {len(prompts)} sequences parted at a near-tie")
    finally:
        llm.close()
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, 0)  # reaped by close()
