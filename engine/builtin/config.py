"""config.json and generation_config.json for a `ModelSpec`, written by hand (sorted keys,
no transformers version) in the classic layout: `rope_theta` at top level and a
`rope_scaling` dict for llama3, which transformers 5 folds into `config.rope_parameters`.
"""
from __future__ import annotations

import json

from engine.builtin.presets import ModelSpec
from engine.builtin.special_tokens import BOS_ID, EOS_ID, PAD_ID

# Bump when the bytes written for the same (arch, preset, seed) change, so caches rebuild.
BUILTIN_FORMAT_VERSION = 2


def hf_config(spec: ModelSpec, seed: int) -> dict[str, object]:
    cfg: dict[str, object] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "attention_dropout": 0.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "dtype": "float32",
        # Provenance; transformers keeps unknown keys as plain attributes.
        "pdcluster_builtin": {
            "arch": spec.arch, "preset": spec.preset, "seed": seed, "format": BUILTIN_FORMAT_VERSION,
        },
    }
    if spec.arch == "llama":
        cfg.update(
            attention_bias=False,
            mlp_bias=False,
            pretraining_tp=1,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": spec.rope_original_max_position,
            },
        )
    elif spec.arch == "mistral":
        cfg.update(sliding_window=None)
    else:  # qwen2 / qwen3: every layer full attention
        cfg.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=spec.num_hidden_layers,
        )
        if spec.arch == "qwen3":
            cfg.update(attention_bias=False)
    return cfg


def generation_config() -> dict[str, object]:
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def dump_json(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
