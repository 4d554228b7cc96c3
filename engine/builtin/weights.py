"""Seeded float32 weights for a `ModelSpec`, generated directly (no transformers model).

One `torch.Generator` walks the tensors in sorted-name order:
- embeddings, lm_head and biases: normal(0, 0.02);
- projection matrices (attention and MLP): normal(0, 1/sqrt(fan_in)). With 0.02 here the
  attention scores of a small model are ~0.05, so attention is nearly uniform, positions
  (rope) barely change the logits and greedy decoding of tied models repeats one token;
  fan-in scaling makes outputs depend on context and position, so engine bugs show;
- RMSNorm weights: 1 + normal(0, 0.05), so ignoring or misapplying a norm weight shows.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.builtin.presets import ModelSpec, tensor_shapes

EMBEDDING_STD = 0.02
BIAS_STD = 0.02
NORM_NOISE_STD = 0.05
SAFETENSORS_METADATA = {"format": "pt"}


def _mean_std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    if name.endswith("norm.weight"):
        return 1.0, NORM_NOISE_STD
    if name.endswith(".bias"):
        return 0.0, BIAS_STD
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0.0, EMBEDDING_STD
    return 0.0, 1.0 / math.sqrt(shape[1])


def make_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(spec).items():
        mean, std = _mean_std(name, shape)
        tensors[name] = torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=gen)
    return tensors


def write_weights(path: Path, spec: ModelSpec, seed: int) -> int:
    """Write model.safetensors (sorted names, metadata {"format": "pt"}); returns the
    parameter count."""
    tensors = make_weights(spec, seed)
    save_file(tensors, str(path), metadata=dict(SAFETENSORS_METADATA))
    return sum(t.numel() for t in tensors.values())
