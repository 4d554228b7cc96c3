"""Roofline step times for a model on a GPU, and a `LatencyModel` derived from them.

A step takes max(compute, memory) time: FLOPs at `mfu` of the GPU's dense BF16 peak, bytes
at `bw_eff` of its HBM bandwidth, plus a fixed per-step overhead and, with tensor parallelism,
two all-reduces per layer over NVLink. Prefill reads the weights once and writes the new
tokens' KV; decode reads the weights once and the KV of every context token. This is what
lets us plan for GPUs we cannot profile; `crosscheck_vidur` measures how far it is off
against real H100 operator timings (microsoft/vidur, MIT).
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadgen.workloads import data_dir
from planning.fit import fit_decode, fit_prefill
from planning.hardware import GPUSpec
from planning.latency import LatencyModel


@dataclass(slots=True, frozen=True)
class ModelShape:
    """The ModelConfig fields a roofline needs; `engine.config.ModelConfig` fits it as well."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False


# Hyperparameters from the models' published config.json files.
PRESETS: dict[str, ModelShape] = {
    "Llama-2-7b": ModelShape(32, 32, 32, 128, 4096, 11008, 32000),
    "Llama-2-70b": ModelShape(80, 64, 8, 128, 8192, 28672, 32000),
    "Llama-3-8B": ModelShape(32, 32, 8, 128, 4096, 14336, 128256),
    "Llama-3-70B": ModelShape(80, 64, 8, 128, 8192, 28672, 128256),
}


def model_shape(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; known: {list(PRESETS)}")
    return PRESETS[name]


def kv_bytes_per_token(cfg, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def layer_params(cfg) -> int:
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * cfg.num_heads * hd * 2 + 2 * h * cfg.num_kv_heads * hd
    return attn + 3 * h * cfg.intermediate_size


def weight_bytes(cfg, dtype_bytes: int = 2) -> int:
    emb = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_layers * layer_params(cfg) + emb) * dtype_bytes


@dataclass(slots=True)
class Roofline:
    cfg: object
    gpu: GPUSpec
    tp: int = 1
    dtype_bytes: int = 2
    # Efficiencies and a per-GEMM launch cost fitted to measured H100 linear ops (Vidur's
    # Llama-2 7B/70B profiles; each model's fit predicts the other's rows within 3-8 % median,
    # see calibrate_on_vidur and docs/capacity-planning.md); used for every GPU.
    mfu: float = 0.7
    bw_eff: float = 0.9
    gemm_launch_s: float = 6e-6
    overhead_s: float = 2e-3   # attention kernels, norms, sampling, framework: a guess, not fitted

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if not (0 < self.mfu <= 1 and 0 < self.bw_eff <= 1):
            raise ValueError(f"mfu and bw_eff must be in (0, 1], got {self.mfu}, {self.bw_eff}")

    def _time(self, flops: float, nbytes: float, tokens: int) -> float:
        compute = flops / self.tp / (self.mfu * self.gpu.bf16_flops)
        memory = nbytes / self.tp / (self.bw_eff * self.gpu.hbm_bytes_per_s)
        comm = 0.0
        if self.tp > 1:  # two ring all-reduces of the activations per layer
            per = 2 * (self.tp - 1) / self.tp * tokens * self.cfg.hidden_size * self.dtype_bytes
            comm = 2 * self.cfg.num_layers * per / self.gpu.interconnect_bytes_per_s
        launches = 4 * self.cfg.num_layers * self.gemm_launch_s  # qkv, o, gate/up, down per layer
        return max(compute, memory) + comm + launches + self.overhead_s

    def _attn_flops(self, tokens: float, ctx: float) -> float:
        return 4 * self.cfg.num_layers * self.cfg.num_heads * self.cfg.head_dim * tokens * ctx

    def prefill_time(self, t: int, c: int = 0, seqs: int = 1) -> float:
        cfg, kv = self.cfg, kv_bytes_per_token(self.cfg, self.dtype_bytes)
        flops = 2 * cfg.num_layers * layer_params(cfg) * t + 2 * cfg.vocab_size * cfg.hidden_size * seqs \
            + self._attn_flops(t, c + t / 2)
        nbytes = weight_bytes(cfg, self.dtype_bytes) + kv * (t + c)
        return self._time(flops, nbytes, t)

    def decode_time(self, b: int, total_ctx: int) -> float:
        cfg, kv = self.cfg, kv_bytes_per_token(self.cfg, self.dtype_bytes)
        flops = 2 * (cfg.num_layers * layer_params(cfg) + cfg.vocab_size * cfg.hidden_size) * b \
            + self._attn_flops(1, total_ctx)
        nbytes = weight_bytes(cfg, self.dtype_bytes) + kv * (total_ctx + b)
        return self._time(flops, nbytes, b)


def roofline_latency_model(cfg, gpu: GPUSpec, tp: int = 1, max_batched_tokens: int = 8192,
                           transfer_overhead_s: float = 1e-3, **kw) -> LatencyModel:
    """Fit the LatencyModel formulas to the roofline over a grid of step shapes."""
    r = Roofline(cfg, gpu, tp, **kw)
    pre = [(t, c, r.prefill_time(t, c)) for t in (16, 64, 256, 512, 1024, 2048, 4096, 8192)
           if t <= max_batched_tokens for c in (0, 512, 2048, 8192)]
    dec = [(b, b * L, r.decode_time(b, b * L)) for b in (1, 4, 16, 64, 128, 256) for L in (128, 1024, 4096)]
    fp, fd = fit_prefill(pre), fit_decode(dec)
    return LatencyModel(
        prefill=fp.coef, decode=fd.coef, transfer_overhead_s=transfer_overhead_s,
        transfer_bytes_per_s=gpu.network_bytes_per_s, kv_bytes_per_token=kv_bytes_per_token(cfg, r.dtype_bytes) // tp,
        max_batched_tokens=max_batched_tokens, source=f"roofline:{gpu.name}:tp{tp}",
        meta={"fit": {"prefill": fp.as_dict(), "decode": fd.as_dict()}, "mfu": r.mfu, "bw_eff": r.bw_eff},
    )


# ---- cross-check against measured H100 operator times (microsoft/vidur profiling CSVs, MIT) ----
def _gemm_time(r: Roofline, t: int, n_in: int, n_out: int, launch_s: float = 0.0) -> float:
    flops = 2 * t * n_in * n_out
    nbytes = (n_in * n_out + t * n_in + t * n_out) * r.dtype_bytes
    return max(flops / (r.mfu * r.gpu.bf16_flops), nbytes / (r.bw_eff * r.gpu.hbm_bytes_per_s)) + launch_s


def _linear_rows(path: str | Path) -> list[tuple[int, int, int, int, int, bool, float]]:
    """(hidden, intermediate, heads, kv heads, tp, tokens, gated, measured s) per Vidur row."""
    rows = list(csv.DictReader(open(path)))
    if not rows:
        raise ValueError(f"{path} has no rows")
    out = []
    for row in rows:
        meas = sum(float(row[f"time_stats.{op}.median"]) for op in
                   ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")) * 1e-3
        out.append((int(row["n_embd"]), int(row["n_expanded_embd"]), int(row["n_head"]), int(row["n_kv_head"]),
                    int(row["num_tensor_parallel_workers"]), int(row["num_tokens"]), row["use_gated_mlp"] == "True",
                    meas))
    return out


def _predict_linear(row, gpu: GPUSpec, mfu: float, bw_eff: float, launch_s: float) -> float:
    h, i, heads, kvh, tp, t, gated, _ = row
    hd = h // heads
    r = Roofline(ModelShape(1, heads, kvh, hd, h, i, 1), gpu, mfu=mfu, bw_eff=bw_eff)
    up = 2 * i if gated else i
    return (_gemm_time(r, t, h, (heads + 2 * kvh) * hd // tp, launch_s) + _gemm_time(r, t, heads * hd // tp, h, launch_s)
            + _gemm_time(r, t, h, up // tp, launch_s) + _gemm_time(r, t, i // tp, h, launch_s))


def calibrate_on_vidur(paths, gpu: GPUSpec | None = None, small_tokens: int = 128) -> dict:
    """mfu, bw_eff and a per-GEMM launch cost that minimise the relative error of the linear
    ops over the given Vidur profiles (a grid search: three parameters, every row). The error
    is the mean of the small-batch (decode-like, <= small_tokens) and large-batch medians, so
    the many large rows do not drown the decode regime."""
    from planning.hardware import get_gpu

    gpu = gpu or get_gpu("H100")
    rows = [r for p in paths for r in _linear_rows(p)]
    small = np.array([r[5] <= small_tokens for r in rows])
    best = None
    for mfu in np.arange(0.40, 0.96, 0.05):
        for bw in np.arange(0.50, 0.96, 0.05):
            for launch in (0.0, 2e-6, 4e-6, 6e-6, 8e-6, 1.2e-5, 1.6e-5, 2e-5):
                e = np.array([abs(_predict_linear(r, gpu, mfu, bw, launch) / r[-1] - 1) for r in rows])
                err = (np.median(e[small]) + np.median(e[~small])) / 2
                if best is None or err < best[0]:
                    best = (err, float(mfu), float(bw), launch)
    return {"mfu": round(best[1], 2), "bw_eff": round(best[2], 2), "launch_s": best[3],
            "train_error": float(best[0])}


def crosscheck_vidur(path: str | Path, gpu: GPUSpec | None = None, small_tokens: int = 128,
                     mfu: float = 0.7, bw_eff: float = 0.9, launch_s: float = 6e-6) -> dict:
    """Roofline vs measured median time of one layer's four linear ops (attn_pre_proj,
    attn_post_proj, mlp_up_proj, mlp_down_proj), per row of a Vidur mlp.csv. Returns relative
    error (pred/measured - 1) summaries by regime (num_tokens <= small_tokens or above)."""
    from planning.hardware import get_gpu

    gpu = gpu or get_gpu("H100")
    errs: dict[str, list[float]] = {"small": [], "large": []}
    for row in _linear_rows(path):
        pred = _predict_linear(row, gpu, mfu, bw_eff, launch_s)
        errs["small" if row[5] <= small_tokens else "large"].append(pred / row[-1] - 1.0)
    out = {"path": str(path), "gpu": gpu.name, "mfu": mfu, "bw_eff": bw_eff, "launch_s": launch_s,
           "small_tokens": small_tokens}
    for k, e in errs.items():
        if e:
            a = np.abs(np.asarray(e))
            out[k] = {"n": len(e), "median_abs": float(np.median(a)), "p90_abs": float(np.quantile(a, 0.9)),
                      "median_signed": float(np.median(e))}
    return out
