"""Deterministic built-in Hugging Face checkpoints (llama, mistral, qwen2, qwen3) written
from a seed, with a byte-level BPE tokenizer; for tests, the demo and CPU benchmarks.

Owns only checkpoint writing; must not import the rest of `engine`, the workers or Ray.
"""
from engine.builtin.presets import ARCHS, PRESETS, ModelSpec, model_spec, param_count
from engine.builtin.writer import ensure_builtin, make_tiny

__all__ = ["ARCHS", "PRESETS", "ModelSpec", "ensure_builtin", "make_tiny", "model_spec", "param_count"]
