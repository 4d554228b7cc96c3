"""Model configuration (no torch: the router reads it too).

`ModelConfig.from_pretrained(dir)` reads a Hugging Face `config.json` and keeps only what the
engine executes; anything it cannot serve (an unknown architecture, sliding-window attention,
an unsupported rope type) fails here, at load, with a message naming it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")


class UnsupportedModelError(ValueError):
    """The checkpoint or config asks for something this engine does not implement."""


def dtype_name(value: str) -> str:
    """The canonical name of a dtype given as 'float32', 'bf16', 'torch.float16', ..."""
    name = str(value).removeprefix("torch.")
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {value!r}")
    return name


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama attention_bias)
    o_bias: bool  # output projection carries a bias (Llama attention_bias)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str | None = None  # 'float32', 'bfloat16' or 'float16' when the checkpoint says
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, at float32 (scale by dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: model_dir must be a Hugging Face checkpoint folder")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; supported: ['silu']")
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        _check_sliding_window(arch, cfg, max_pos)
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}"
            )
        if cfg.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError(f"pretraining_tp={cfg['pretraining_tp']} is not supported; supported: 1")
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        ckpt_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=ckpt_dtype if ckpt_dtype in DTYPES else None,
            raw=cfg,
        )


def _check_sliding_window(arch: str, cfg: dict, max_pos: int) -> None:
    window = cfg.get("sliding_window")
    if window is None:
        return
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
        return
    if int(window) < max_pos:
        raise UnsupportedModelError(
            f"sliding_window={window} attention is not supported (only full attention, or a window "
            f">= max_position_embeddings={max_pos})"
        )


def _parse_rope(cfg: dict) -> RopeConfig:
    # transformers >= 5 nests everything under rope_parameters; older checkpoints use
    # a top-level rope_theta plus an optional rope_scaling dict.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    partial = cfg.get("partial_rotary_factor", merged.get("partial_rotary_factor", 1.0))
    if partial not in (1, 1.0, None):
        raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported; supported: 1.0")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    factor = float(merged.get("factor", 1.0))
    if not (factor >= 1.0 and math.isfinite(factor)):
        raise UnsupportedModelError(f"rope_scaling factor must be >= 1, got {factor}")
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type="linear", factor=factor)
    return RopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )
