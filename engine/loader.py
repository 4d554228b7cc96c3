"""Load a Hugging Face checkpoint folder (single or sharded safetensors) into `DecoderLM`.

Checkpoint names map onto the fused layout of engine.model: q/k/v projections concatenated into
`qkv_proj`, gate/up into `gate_up_proj`. A missing or unexpected tensor, or a shape that does
not match the config, fails the load with the tensor's name.

A tensor-parallel rank (`shard`, engine/parallel.py) reads the whole checkpoint and keeps its
slices: q/k/v and gate/up rows of its heads and MLP columns, o_proj and down_proj columns
(their biases whole: added once, after the all-reduce); everything else whole.
"""
from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig, UnsupportedModelError
from engine.model import AllReduce, DecoderLM
from engine.parallel import TPShard

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise UnsupportedModelError(f"{model_dir}: only safetensors checkpoints are supported (found .bin/.pt files)")
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not name.endswith(_IGNORED_SUFFIXES):
                    tensors[name] = f.get_tensor(name)
    return tensors


def _fused_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the checkpoint tensors concatenated (dim 0) to make it."""
    names: dict[str, list[str]] = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        names[dst + "self_attn.qkv_proj.weight"] = [attn + p + "_proj.weight" for p in "qkv"]
        if cfg.qkv_bias:
            names[dst + "self_attn.qkv_proj.bias"] = [attn + p + "_proj.bias" for p in "qkv"]
        names[dst + "self_attn.o_proj.weight"] = [attn + "o_proj.weight"]
        if cfg.o_bias:
            names[dst + "self_attn.o_proj.bias"] = [attn + "o_proj.bias"]
        if cfg.qk_norm:
            names[dst + "self_attn.q_norm.weight"] = [attn + "q_norm.weight"]
            names[dst + "self_attn.k_norm.weight"] = [attn + "k_norm.weight"]
        mlp = src + "mlp."
        names[dst + "mlp.gate_up_proj.weight"] = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
        names[dst + "mlp.down_proj.weight"] = [mlp + "down_proj.weight"]
        if cfg.mlp_bias:
            names[dst + "mlp.gate_up_proj.bias"] = [mlp + "gate_proj.bias", mlp + "up_proj.bias"]
            names[dst + "mlp.down_proj.bias"] = [mlp + "down_proj.bias"]
        names[dst + "input_layernorm.weight"] = [src + "input_layernorm.weight"]
        names[dst + "post_attention_layernorm.weight"] = [src + "post_attention_layernorm.weight"]
    return names


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_")
_init_lock = threading.Lock()


@contextlib.contextmanager
def _no_init():
    """torch.nn.init's initializers do nothing inside (modules built here get every tensor
    from the checkpoint)."""
    with _init_lock:
        saved = {name: getattr(torch.nn.init, name) for name in _INITS}
        try:
            for name in _INITS:
                setattr(torch.nn.init, name, _keep)
            yield
        finally:
            for name, fn in saved.items():
                setattr(torch.nn.init, name, fn)


def _keep(tensor, *args, **kwargs):
    return tensor


def shard_tensor(name: str, value: torch.Tensor, cfg: ModelConfig, shard: TPShard) -> torch.Tensor:
    """The part of checkpoint tensor `name` that rank `shard` holds (a copy, so the whole
    tensor can be freed), or `value` itself when every rank holds all of it."""
    if shard.world == 1:
        return value
    if name == "lm_head.weight" and shard.vocab_parallel:
        return value[shard.vocab_start : shard.vocab_start + shard.vocab_size].clone()
    hd = cfg.head_dim
    q = slice(shard.q_head_start * hd, (shard.q_head_start + shard.num_heads) * hd)
    kv = slice(shard.kv_head_start * hd, (shard.kv_head_start + shard.num_kv_heads) * hd)
    mlp = slice(shard.intermediate_start, shard.intermediate_start + shard.intermediate_size)
    module, _, kind = name.rpartition(".")
    proj = module.rpartition(".")[2]
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}.get(proj)
    if rows is not None:
        return value[rows].clone()
    cols = {"o_proj": q, "down_proj": mlp}.get(proj)
    if cols is not None and kind == "weight":
        return value[:, cols].contiguous()
    return value


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               shard: TPShard | None = None, all_reduce: AllReduce | None = None) -> DecoderLM:
    """The model, or with `shard` one tensor-parallel rank's part of it (engine/parallel.py)."""
    model_dir = Path(model_dir)
    shard = shard or TPShard.of(cfg)
    tensors = read_tensors(model_dir)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints still store a copy
    fused = _fused_names(cfg)
    expected = {name for parts in fused.values() for name in parts}
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing:
        raise UnsupportedModelError(f"{model_dir}: checkpoint lacks tensors the config needs, e.g. {missing[:5]}")
    if unexpected:
        raise UnsupportedModelError(f"{model_dir}: checkpoint has tensors this engine does not use, e.g. {unexpected[:5]}")

    # Parameters on the meta device (no memory), left uninitialized: the checkpoint's tensors are
    # assigned below. An init on meta runs torch's Python reference kernels, whose first use
    # imports torch._dynamo: 2 s or more of every worker's start-up (and of a restart).
    with torch.device("meta"), _no_init():
        model = DecoderLM(cfg, dtype, max_positions, shard, all_reduce)
    state = {}
    params = dict(model.named_parameters())
    for ours, parts in fused.items():
        pieces = [shard_tensor(p, tensors.pop(p), cfg, shard) for p in parts]
        value = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        if tuple(value.shape) != tuple(params[ours].shape):
            raise UnsupportedModelError(
                f"{model_dir}: tensor {parts} has shape {tuple(value.shape)}, config implies {tuple(params[ours].shape)}"
            )
        state[ours] = value.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = model.rotary.__class__(cfg.rope, cfg.head_dim, max_positions, dtype).to(device)
    return model.eval()
