"""Built-in checkpoints: byte-identical from a seed, loadable by transformers as the right
class with the intended structure, a tokenizer that decodes every id, and a model that runs."""
from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import engine.builtin as builtin
from engine.builtin import cli
from engine.builtin.presets import model_spec, param_count
from engine.builtin.special_tokens import BOS_ID, EOS_ID, IM_END_ID, IM_START_ID, PAD_ID
from engine.builtin.writer import CHECKPOINT_FILES

HF_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
UTF8_TEXT = "héllo wörld — 你好 🙂"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("builtin")
    return {arch: builtin.make_tiny(root / arch, arch=arch) for arch in builtin.ARCHS}


@pytest.fixture(scope="module")
def models(checkpoints):
    loaded = {}
    for arch, path in checkpoints.items():
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        loaded[arch] = (model.eval(), info)
    return loaded


def test_same_seed_gives_same_bytes_and_other_seed_other_weights(checkpoints, tmp_path):
    for arch, first in checkpoints.items():
        again = builtin.make_tiny(tmp_path / arch, arch=arch, seed=0)
        assert sorted(p.name for p in again.iterdir()) == sorted(CHECKPOINT_FILES)
        for name in CHECKPOINT_FILES:
            assert (first / name).read_bytes() == (again / name).read_bytes(), (arch, name)
    other = builtin.make_tiny(tmp_path / "seed1", arch="llama", seed=1)
    base = checkpoints["llama"]
    assert (other / "model.safetensors").read_bytes() != (base / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()


def test_safetensors_sorted_float32_with_fixed_metadata(checkpoints):
    with safe_open(checkpoints["qwen2"] / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = list(f.keys())
        assert names == sorted(names)
        assert all(f.get_tensor(n).dtype == torch.float32 for n in names[:5])


@pytest.mark.parametrize("arch", builtin.ARCHS)
def test_transformers_loads_every_weight_into_the_right_class(arch, checkpoints, models):
    model, info = models[arch]
    spec = model_spec(arch, "tiny")
    assert type(model).__name__ == HF_CLASS[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.num_parameters() == param_count(spec)
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (arch in ("qwen2", "qwen3")) == cfg.tie_word_embeddings
    attn = model.model.layers[0].self_attn
    has_bias = [getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert has_bias == ([True, True, True, False] if arch == "qwen2" else [False] * 4)
    assert hasattr(attn, "q_norm") == hasattr(attn, "k_norm") == (arch == "qwen3")
    if arch == "qwen3":
        assert cfg.head_dim == 2 * cfg.hidden_size // cfg.num_attention_heads
        assert attn.q_norm.weight.shape == (cfg.head_dim,)
    # Loaded values are the file's values (nothing silently re-initialised), norms not all 1.
    with safe_open(checkpoints[arch] / "model.safetensors", "pt") as f:
        state = model.state_dict()
        for name in f.keys():
            assert torch.equal(state[name], f.get_tensor(name)), name
        norm = f.get_tensor("model.norm.weight")
        assert 0.02 < (norm - 1).std() < 0.1


def test_rope_parameters_as_transformers_reads_them(models):
    llama = models["llama"][0].config.rope_parameters
    assert llama["rope_type"] == "llama3" and llama["rope_theta"] == 500000.0
    assert llama["factor"] == 8.0 and (llama["low_freq_factor"], llama["high_freq_factor"]) == (1.0, 4.0)
    assert llama["original_max_position_embeddings"] < models["llama"][0].config.max_position_embeddings
    rotary = models["llama"][0].model.rotary_emb
    dim = models["llama"][0].config.head_dim
    plain = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    assert not torch.allclose(rotary.inv_freq.float(), plain)  # the scaling really changes frequencies
    for arch in ("mistral", "qwen2", "qwen3"):
        params = models[arch][0].config.rope_parameters
        assert params["rope_type"] == "default" and params["rope_theta"] == 1e6
    assert models["mistral"][0].config.sliding_window is None
    for arch in ("qwen2", "qwen3"):
        cfg = models[arch][0].config
        assert cfg.use_sliding_window is False and set(cfg.layer_types) == {"full_attention"}


@pytest.mark.parametrize("arch", builtin.ARCHS)
def test_forward_is_finite_and_greedy_generate_runs(arch, models):
    model = models[arch][0]
    ids = torch.tensor([[354, 397, 586, 17, 900, 1200]])
    with torch.no_grad():
        logits = model(ids).logits
        assert logits.shape == (1, 6, 2048) and torch.isfinite(logits).all()
        # Relative positions must matter (attention is not near-uniform), so rope bugs show.
        same_position = model(ids, position_ids=torch.zeros_like(ids)).logits
        assert (logits - same_position).abs().max() > 1e-2
        out = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert out.shape == (1, 26)
    assert len(set(out[0, 6:].tolist())) > 1  # greedy output is not one token repeated


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_decodes_every_id_and_round_trips(arch, checkpoints):
    tok = AutoTokenizer.from_pretrained(checkpoints[arch])
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == 2048
    texts = tok.batch_decode([[i] for i in range(2048)])
    assert len(texts) == 2048 and len(set(tok.convert_ids_to_tokens(list(range(2048))))) == 2048
    partial = [i for i, t in enumerate(texts) if "\ufffd" in t]
    assert len(partial) > 64  # lone continuation/lead bytes: incremental detokenizing must hold them back
    assert bytes([0xE4]).decode("utf-8", "replace") == texts[5 + 0xE4]
    raw = Tokenizer.from_file(str(checkpoints[arch] / "tokenizer.json"))
    for text in ("The prefill worker fills the cache, then decode streams tokens.", UTF8_TEXT,
                 "  spaces\n\nand 12345 digits"):
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids  # AutoTokenizer and tokenizer.json agree
        assert BOS_ID not in ids and tok.decode(ids) == text
    assert len(tok.encode("The prefill worker")) == 3  # learned merges are real subwords


def test_special_tokens_and_chat_template(checkpoints):
    tok = AutoTokenizer.from_pretrained(checkpoints["qwen3"])
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START_ID, IM_END_ID]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(prompt)[0] == IM_START_ID
    gen = json.loads((checkpoints["qwen3"] / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (BOS_ID, EOS_ID)


def test_param_counts_per_preset():
    assert 1_000_000 <= param_count(model_spec("llama", "tiny")) <= 3_000_000
    assert 5_000_000 <= param_count(model_spec("qwen2", "small")) <= 10_000_000
    for arch in builtin.ARCHS:
        assert 90_000_000 <= param_count(model_spec(arch, "bench")) <= 130_000_000


def test_invalid_arguments_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="arch must be one of llama, mistral, qwen2, qwen3"):
        builtin.make_tiny(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="preset must be one of tiny, small, bench"):
        builtin.ensure_builtin(preset="huge", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="seed"):
        builtin.make_tiny(tmp_path, seed=-1)


def test_ensure_builtin_caches_and_rebuilds_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    path = builtin.ensure_builtin("mistral", "tiny", seed=3)
    assert path == tmp_path / "models" / "mistral-tiny-seed3"
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert builtin.ensure_builtin("mistral", "tiny", seed=3) == path and weights.stat().st_mtime_ns == stamp
    (path / "config.json").write_text("{}")  # as if written by an older format
    assert builtin.ensure_builtin("mistral", "tiny", seed=3) == path
    assert json.loads((path / "config.json").read_text())["model_type"] == "mistral"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["mistral-tiny-seed3"]  # no temp left


def test_cli_writes_checkpoint(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([str(tmp_path / "x"), "--arch", "qwen3", "--preset", "tiny", "--seed", "2"])
    assert cli.run(args) == 0
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in out and f"{param_count(model_spec('qwen3', 'tiny')):,}" in out
    assert all((tmp_path / "x" / name).is_file() for name in CHECKPOINT_FILES)
    assert math.isclose(json.loads((tmp_path / "x" / "config.json").read_text())["rope_theta"], 1e6)
