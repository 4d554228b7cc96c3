"""Shapes of the built-in models: one `ModelSpec` per (arch, preset), pure Python (no torch).

Presets fix the size; the arch then decides the Hugging Face class, rope settings, bias,
embedding tying and (for qwen3) an explicit head_dim that differs from hidden/heads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ARCHS: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
PRESETS: tuple[str, ...] = ("tiny", "small", "bench")


@dataclass(frozen=True, slots=True)
class PresetSize:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


_SIZES: dict[str, PresetSize] = {
    "tiny": PresetSize(128, 4, 4, 2, 384, 2048, 1024),
    "small": PresetSize(256, 6, 8, 4, 768, 8192, 2048),
    "bench": PresetSize(768, 12, 12, 4, 2048, 32000, 4096),
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything needed to write one checkpoint: sizes plus the arch-specific switches."""

    arch: str
    preset: str
    hf_class: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    # "gpt2": ByteLevel regex pre-tokenizer; "qwen": NFC + Qwen2 split regex, which is what
    # transformers' Qwen2Tokenizer rebuilds regardless of tokenizer.json (see tokenizer.py).
    tokenizer_style: str = "gpt2"
    # llama3 rope scaling: long-context frequencies are stretched relative to this length.
    rope_original_max_position: int | None = None


def check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(allowed)}; got {value!r}")


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63); got {seed!r}")
    return seed


def model_spec(arch: str, preset: str) -> ModelSpec:
    check_choice("arch", arch, ARCHS)
    check_choice("preset", preset, PRESETS)
    size = _SIZES[preset]
    default_head_dim = size.hidden_size // size.num_attention_heads
    common = dict(
        arch=arch,
        preset=preset,
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        intermediate_size=size.intermediate_size,
        vocab_size=size.vocab_size,
        max_position_embeddings=size.max_position_embeddings,
    )
    if arch == "llama":
        return ModelSpec(
            hf_class="LlamaForCausalLM", model_type="llama", head_dim=default_head_dim,
            rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            qkv_bias=False, qk_norm=False,
            rope_original_max_position=size.max_position_embeddings // 4, **common,
        )
    if arch == "mistral":
        return ModelSpec(
            hf_class="MistralForCausalLM", model_type="mistral", head_dim=default_head_dim,
            rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
            qkv_bias=False, qk_norm=False, **common,
        )
    if arch == "qwen2":
        return ModelSpec(
            hf_class="Qwen2ForCausalLM", model_type="qwen2", head_dim=default_head_dim,
            rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
            qkv_bias=True, qk_norm=False, tokenizer_style="qwen", **common,
        )
    # qwen3: like Qwen3-0.6B, head_dim is twice hidden/heads, so q_proj widens the stream.
    return ModelSpec(
        hf_class="Qwen3ForCausalLM", model_type="qwen3", head_dim=2 * default_head_dim,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        qkv_bias=False, qk_norm=True, tokenizer_style="qwen", **common,
    )


def tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Hugging Face state-dict names and shapes, sorted by name (tied models omit lm_head)."""
    h, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if spec.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, spec.intermediate_size)
    return dict(sorted(shapes.items()))


def param_count(spec: ModelSpec) -> int:
    total = 0
    for shape in tensor_shapes(spec).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def default_cache_root() -> Path:
    """$PDCLUSTER_CACHE/models if set, else ~/.cache/pdcluster/models."""
    env = os.environ.get("PDCLUSTER_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "pdcluster"
    return base / "models"
