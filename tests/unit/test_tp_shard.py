"""Tensor-parallel sharding without processes (engine/parallel.py, engine/loader.py): which heads
each rank holds, that the ranks' weight slices put back together are the checkpoint's, and the
step message the leader sends its followers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from engine.loader import load_model
from engine.parallel import StepInputs, TPShard, check_tensor_parallel, decode_step, encode_step


def _cfg(heads: int, kv_heads: int, inter: int = 64) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 8 * heads,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    })


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1), (8, 2), (12, 4), (32, 8), (16, 1)])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_q_head_is_on_exactly_one_rank_with_its_kv_head(heads, kv_heads, world):
    cfg = _cfg(heads, kv_heads)
    if heads % world or (kv_heads % world and world % kv_heads):
        with pytest.raises(ValueError, match=rf"tensor_parallel_size={world}.*num_attention_heads={heads}"):
            TPShard.of(cfg, 0, world)
        return
    group = heads // kv_heads
    owners: dict[int, int] = {}
    kv_copies = [0] * kv_heads
    for rank in range(world):
        s = TPShard.of(cfg, rank, world)
        assert s.num_heads == heads // world
        assert s.num_kv_heads == max(1, kv_heads // world)
        for kv in s.kv_heads:
            kv_copies[kv] += 1
        for q in s.q_heads:
            assert q not in owners
            owners[q] = rank
            assert q // group in s.kv_heads, f"rank {rank}'s q head {q} reads KV head {q // group}, not held there"
        if world > kv_heads:
            assert s.kv_head_start == rank * kv_heads // world
    assert sorted(owners) == list(range(heads))
    assert kv_copies == [max(1, world // kv_heads)] * kv_heads  # replicated only when world > kv_heads


def test_intermediate_size_must_divide_too():
    with pytest.raises(ValueError, match="intermediate_size=66"):
        check_tensor_parallel(_cfg(4, 2, inter=66), 4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("world", [2, 4])
def test_rank_slices_put_together_are_the_checkpoint(arch, world, tiny_model):
    # qwen2 carries q/k/v biases (sliced with their rows), qwen3 per-head q/k norms (whole)
    model_dir = tiny_model(arch)
    cfg = ModelConfig.from_pretrained(model_dir)
    kw = dict(dtype=torch.float32, device=torch.device("cpu"), max_positions=64)
    full = dict(load_model(model_dir, cfg, **kw).named_parameters())
    shards = [dict(load_model(model_dir, cfg, shard=TPShard.of(cfg, r, world), all_reduce=lambda t: t, **kw)
                   .named_parameters()) for r in range(world)]
    hd, h, k = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    for name, value in full.items():
        parts = [s[name] for s in shards]
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            q_local = h // world * hd
            q = torch.cat([p[:q_local] for p in parts])
            assert torch.equal(q, value[: h * hd])
            kv_local = max(1, k // world) * hd
            for i, p in enumerate(parts):
                s = TPShard.of(cfg, i, world)
                lo = s.kv_head_start * hd
                assert torch.equal(p[q_local : q_local + kv_local], value[h * hd + lo : h * hd + lo + kv_local])
                assert torch.equal(p[q_local + kv_local :], value[(h + k) * hd + lo : (h + k) * hd + lo + kv_local])
        elif name.endswith("gate_up_proj.weight"):
            half = cfg.intermediate_size
            assert torch.equal(torch.cat([p[: half // world] for p in parts]), value[:half])
            assert torch.equal(torch.cat([p[half // world :] for p in parts]), value[half:])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), value)
        else:  # norms, embeddings, the LM head, row-parallel biases: whole on every rank
            for p in parts:
                assert torch.equal(p, value), name


def test_step_message_round_trips():
    s = StepInputs(
        input_ids=np.array([5, 6, 7, 8], dtype=np.int64), positions=np.array([9, 0, 1, 2], dtype=np.int64),
        slot_mapping=np.array([41, 16, 17, 18], dtype=np.int64), query_lens=[1, 3], context_lens=[10, 3],
        block_tables=[[0, 2], [1]], num_decodes=1,
    )
    back = decode_step(encode_step(s))
    for f in ("input_ids", "positions", "slot_mapping"):
        assert np.array_equal(getattr(back, f), getattr(s, f)) and getattr(back, f).flags.writeable
    assert (back.query_lens, back.context_lens, back.block_tables, back.num_decodes) == ([1, 3], [10, 3], [[0, 2], [1]], 1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied LM head, tied to the embedding
def test_vocab_parallel_lm_head_rows_put_together_are_the_checkpoint(arch, tiny_model):
    model_dir = tiny_model(arch)
    cfg = ModelConfig.from_pretrained(model_dir)
    kw = dict(dtype=torch.float32, device=torch.device("cpu"), max_positions=64)
    full = load_model(model_dir, cfg, **kw)
    hidden = torch.randn(3, cfg.hidden_size)
    parts = [load_model(model_dir, cfg, shard=TPShard.of(cfg, r, 2, vocab_parallel=True), all_reduce=lambda t: t, **kw)
             .compute_logits(hidden) for r in range(2)]
    assert parts[0].shape == (3, cfg.vocab_size // 2)
    torch.testing.assert_close(torch.cat(parts, dim=1), full.compute_logits(hidden), rtol=0, atol=1e-5)
    odd = ModelConfig.from_dict({**cfg.raw, "vocab_size": cfg.vocab_size - 1})
    with pytest.raises(ValueError, match=f"vocab_size={cfg.vocab_size - 1}"):
        TPShard.of(odd, 0, 2, vocab_parallel=True)
    assert TPShard.of(odd, 0, 2).vocab_size == cfg.vocab_size - 1  # replicated: any vocabulary
