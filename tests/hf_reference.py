"""Greedy reference outputs from Hugging Face transformers, one prompt at a time (no padding, an
explicit all-ones attention mask so a prompt token equal to pad_token_id is not masked)."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = _model(str(model_dir))
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            seq = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
            )
            outs.append(seq[0, len(p):].tolist())
    return outs


def random_prompts(lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]
