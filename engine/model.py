"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3.

Tokens of every sequence in a step are packed into one flat batch (no padding). Attention goes
through an `AttentionBackend`, which owns the paged KV cache reads and writes; everything else
is plain torch ops in the same order as Hugging Face's implementation, so float32 results match.
q/k/v and gate/up projections are fused into one matmul each (weights concatenated at load).

Under tensor parallelism (engine/parallel.py) a rank's model is built for its `TPShard`: its q
and KV heads, its slice of the MLP; o_proj and down_proj are `RowParallelLinear`s, whose
partial outputs are summed over the ranks by `all_reduce` before the bias is added.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend
from engine.config import ModelConfig
from engine.parallel import TPShard
from engine.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(dtype)


AllReduce = Callable[[torch.Tensor], torch.Tensor]


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over the ranks: each computes a partial
    product, `all_reduce` sums them in place, then the bias (whole on every rank) is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, all_reduce: AllReduce) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def _row_linear(in_features: int, out_features: int, bias: bool, all_reduce: AllReduce | None) -> nn.Linear:
    if all_reduce is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, all_reduce)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: TPShard, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.q_size = shard.num_heads * cfg.head_dim
        self.kv_size = shard.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = _row_linear(self.q_size, cfg.hidden_size, cfg.o_bias, all_reduce)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, attn: AttentionBackend, kv_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn.forward(self.layer, q, k, v, kv_cache)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        inter = shard.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
        self.down_proj = _row_linear(inter, cfg.hidden_size, cfg.mlp_bias, all_reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: TPShard, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, shard, all_reduce)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard, all_reduce)

    def forward(self, x, cos, sin, attn, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int, shard: TPShard | None = None,
                 all_reduce: AllReduce | None = None) -> None:
        """The whole model, or with `shard` (and the group's `all_reduce` when shard.world > 1)
        one tensor-parallel rank's part of it."""
        super().__init__()
        self.config = cfg
        self.shard = shard = shard or TPShard.of(cfg)
        if shard.world > 1 and all_reduce is None:
            raise ValueError("a tensor-parallel shard needs its group's all_reduce")
        reduce = all_reduce if shard.world > 1 else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard, reduce) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, shard.vocab_size, bias=False)
        with torch.device("cpu"):  # computed, never on meta (engine.loader: it sets the real device's table)
            self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, dtype)

    @torch.inference_mode()
    def forward(self, input_ids, positions, attn: AttentionBackend, kv_caches: list[torch.Tensor],
                on_layer: Callable[[int], None] | None = None, final_norm: bool = True) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token. `on_layer(i)` runs as
        soon as layer i's K/V are in the cache (the prefill worker starts sending them).
        `final_norm=False`: a follower rank, which computes no logits, skips the norm."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, cos, sin, attn, kv_cache)
            if on_layer is not None:
                on_layer(i)
        return self.norm(x) if final_norm else x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's LM head rows: the whole vocabulary unless vocab-parallel."""
        if self.lm_head is None:
            s = self.shard
            weight = self.embed_tokens.weight[s.vocab_start : s.vocab_start + s.vocab_size]
        else:
            weight = self.lm_head.weight
        return F.linear(hidden, weight).float()
