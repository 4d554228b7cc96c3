"""A checkpoint the engine cannot serve fails at load, naming what is unsupported."""
from __future__ import annotations

import json
import shutil

import pytest

from engine.config import ModelConfig, UnsupportedModelError

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, "sliding_window=64"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads=3"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_config_is_named(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict({**BASE, **change})


def test_rope_parameters_in_both_styles():
    old = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                 "original_max_position_embeddings": 64}})
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                 "original_max_position_embeddings": 64}})
    assert old.rope == new.rope and old.rope.rope_type == "llama3" and old.rope.theta == 5e5
    qwen = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "use_sliding_window": False})
    assert qwen.qkv_bias and not qwen.o_bias


def test_checkpoint_missing_a_tensor_fails_at_load(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine import LLM

    src = tiny_model("qwen2")
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        LLM(dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM"):
        LLM(dst)


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model, tmp_path, make_llm):
    from safetensors.torch import load_file, save_file

    from engine import SamplingParams

    src = tiny_model("llama")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = make_llm(src).generate([[1, 2, 3, 4]], params)[0].token_ids
    b = make_llm(dst).generate([[1, 2, 3, 4]], params)[0].token_ids
    assert a == b
