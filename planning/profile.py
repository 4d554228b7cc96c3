"""Profile the real engine on this machine and fit a `LatencyModel` to the step times.

Prefill steps are timed by new tokens and cached-prefix length (the prefix is prefilled once
first, so prefix caching serves it), decode steps by batch size and context. One torch thread,
as each cluster worker runs. KV transfer is timed per transport (`nixl`, `grpc`) with this
model's paged KV layout between two real processes (`bench.kv_bench.measure_transfer`), by
prompt length, and fitted as a fixed cost plus bytes over bandwidth.
"""
from __future__ import annotations

import random
import time

import torch
from tqdm import tqdm

from planning.fit import fit_decode, fit_prefill, fit_transfer
from planning.latency import LatencyModel

FULL = {"prefill_tokens": (16, 64, 128, 256, 512, 1024, 2048), "cached": (0, 256, 512),
        "batch": (1, 2, 4, 8, 16, 32), "ctx_per_seq": (64, 256, 1024), "decode_steps": 4,
        "transfer_tokens": (64, 256, 1024, 2048), "transfer_repeats": 3}
QUICK = {"prefill_tokens": (16, 64, 256, 512), "cached": (0, 64), "batch": (1, 2, 4, 8),
         "ctx_per_seq": (32, 96), "decode_steps": 3, "transfer_tokens": (64, 512), "transfer_repeats": 2}
TRANSPORTS = ("nixl", "grpc")


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def profile_transfer(cfg, dtype: str, page_size: int, transports=TRANSPORTS, grid: dict = FULL) -> dict:
    """Per transport: the fit {coef: (x0 s, bytes/s), r2, ...} and the raw (bytes, seconds) points
    (every repeat), for this model's KV layout moved between two processes here."""
    from loadgen.kv import measure_transfer

    spec_kw = dict(model_id="profile", num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    layout_kw = dict(num_layers=cfg.num_layers, page_size=page_size, head_start=0, num_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, dtype=dtype)
    out = {}
    for transport in tqdm(transports, desc="transfer", leave=False):
        rows = measure_transfer(transport, spec_kw, layout_kw, grid["transfer_tokens"], grid["transfer_repeats"])
        points = [(nbytes, t) for _, nbytes, times in rows for t in times]
        out[transport] = {"fit": fit_transfer(points).as_dict(), "points": points}
    return out


def fit_grid(grid: dict, max_model_len: int) -> dict:
    """`grid` less the shapes a model of `max_model_len` positions cannot take, with the prefill
    shapes spelled out as `prefill_shapes` [(new tokens, cached prefix)]: a prompt plus its
    prefix, or a decode context plus the timed steps, must fit (64 positions to spare). Where
    prompt lengths were dropped, the longest that fits is timed instead, so the fit reaches
    the context's end (a quadratic fitted to 1,024 tokens overshot 2,000-token prompts by 50 %)."""
    shapes = []
    for c in grid["cached"]:
        fit = [t for t in grid["prefill_tokens"] if t + c + 80 <= max_model_len]
        if len(fit) < len(grid["prefill_tokens"]) and max_model_len - 80 - c > max(fit, default=0):
            fit.append(max_model_len - 80 - c)  # the longest prompt the context takes: no extrapolation
        shapes += [(t, c) for t in fit]
    budget = max((t + c for t, c in shapes), default=0) + 16  # the engine's step budget and, +64, its context
    out = dict(grid, prefill_shapes=shapes, budget=budget,
               ctx_per_seq=tuple(L for L in grid["ctx_per_seq"] if L + grid["decode_steps"] + 1 < budget + 64),
               transfer_tokens=tuple(t for t in grid["transfer_tokens"] if t <= max_model_len))
    if not shapes or not out["ctx_per_seq"] or not out["transfer_tokens"]:
        raise ValueError(f"max_model_len={max_model_len} leaves no shape of the profile grid")
    return out


def profile_engine(model: str = "bench", dtype: str = "bfloat16", quick: bool = False, seed: int = 0,
                   transports=TRANSPORTS, page_size: int = 16, serving: bool = False,
                   load_rate: float | None = None, load_requests: int | None = None) -> dict:
    """With `serving`, decode steps and the first token's delay are then measured through a
    real local cluster as well (serving_profile.py), and those go into the latency model; with
    `load_rate` too, a load run at that rate fits what staggered load costs beyond them."""
    from engine import SamplingParams
    from engine.core import EngineCore

    from engine.builtin import PRESETS, ensure_builtin
    from engine.config import ModelConfig

    torch.set_num_threads(1)
    # a preset name is resolved explicitly: "bench" is also a folder in the repo root
    model_dir = ensure_builtin(preset=model) if model in PRESETS else model
    limit = ModelConfig.from_pretrained(model_dir).max_position_embeddings
    grid = fit_grid(QUICK if quick else FULL, limit)
    shapes, budget = grid["prefill_shapes"], grid["budget"]
    # detokenize as the decode worker does (it streams text): part of every decode step
    eng = EngineCore(model_dir, dtype=dtype, detokenize=True, max_num_batched_tokens=budget,
                     max_model_len=budget + 64, max_num_seqs=max(grid["batch"]), page_size=page_size)
    vocab = eng.config.vocab_size
    rng = random.Random(seed)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eng.add_request(_prompt(rng, 32, vocab), one)  # warm-up
    while eng.has_unfinished_requests():
        eng.step()
    prefill, decode = [], []
    for t, c in tqdm(shapes, desc="prefill", leave=False):
        prefix = _prompt(rng, c, vocab)
        if c:
            eng.add_request(prefix, one)
            while eng.has_unfinished_requests():
                eng.step()
        best = float("inf")
        for _ in range(2):  # the faster of two repeats: single-thread CPU timings are noisy
            eng.add_request(prefix + _prompt(rng, t, vocab), one)
            t0 = time.perf_counter()
            eng.step()
            best = min(best, time.perf_counter() - t0)
            while eng.has_unfinished_requests():
                eng.step()
        prefill.append((t, c, best))
    for b in tqdm(grid["batch"], desc="decode", leave=False):
        for L in grid["ctx_per_seq"]:
            steps = grid["decode_steps"]
            # enough tokens that no request finishes while a chunked batch prefill completes
            params = SamplingParams(temperature=0, max_tokens=eng.max_model_len - L - 1, ignore_eos=True)
            rids = [eng.add_request(_prompt(rng, L, vocab), params) for _ in range(b)]
            sched = eng.scheduler
            # prefill the batch first (it may take several chunked steps): only steps in
            # which all b sequences decode are timed, at their context then
            while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
                eng.step()
            for _ in range(steps):
                ctx = sum(r.num_computed_tokens + 1 for r in sched.running)
                t0 = time.perf_counter()
                eng.step()
                decode.append((b, ctx, time.perf_counter() - t0))
            for rid in rids:
                eng.abort_request(rid)
    fp, fd = fit_prefill(prefill), fit_decode(decode)
    kv = eng.config.kv_bytes_per_token * torch.finfo(getattr(torch, dtype)).bits // 8
    transfer = profile_transfer(eng.config, dtype, page_size, transports, grid) if transports else {}
    transfers = {k: tuple(v["fit"]["coef"]) for k, v in transfer.items()}
    x0, bw = transfers.get("nixl", next(iter(transfers.values()), (0.0, float("inf"))))
    lm = LatencyModel(prefill=fp.coef, decode=fd.coef, transfer_overhead_s=x0, transfer_bytes_per_s=bw,
                      kv_bytes_per_token=kv, max_batched_tokens=budget, num_layers=eng.config.num_layers,
                      transfers=transfers, source=f"profile:{model}:{dtype}",
                      meta={"threads": 1, "quick": quick, "max_model_len": eng.config.max_position_embeddings,
                            "page_size": page_size})
    fits = {"prefill": fp.as_dict(), "decode": fd.as_dict(), **{f"transfer_{k}": v["fit"] for k, v in transfer.items()}}
    points = {"prefill": prefill, "decode": decode, **{f"transfer_{k}": v["points"] for k, v in transfer.items()}}
    if serving:
        from planning.serving_profile import profile_serving

        del eng  # its KV memory, before the cluster's workers take theirs
        lm, served = profile_serving(model, dtype, lm, quick, transport=next(iter(transfers), "nixl"),
                                     load_rate=load_rate, load_requests=load_requests)
        fits["served_decode"] = served["decode_fit"]
        points.update(served_prefill=served["points"]["prefill"], served_decode=served["points"]["decode"])
    out = {"latency_model": lm.to_json(), "fit": fits, "points": points, "model": model, "dtype": dtype}
    if serving and "load" in served:
        out["load"] = served["load"]  # the load run's fit (not a least-squares fit of points like the others)
    return out
