"""Time prefill and decode through a real local cluster: what a user of the endpoint sees.

The engine profile (profile.py) times bare `EngineCore` steps. A served request pays more: the
router's placement and Ray calls before the prefill, and, on every decode step, one output per
stream through the decode actor, Ray and the router, work that shares the decode process with
the engine thread. On this machine that made served decode steps ~1.7x the bare ones, which no
engine profile can predict. So, as Dynamo's profiler does, this one measures the deployment
itself with synthetic requests of controlled shapes (never the workload being predicted).
A shared machine drifts by tens of percent within minutes, so `plan validate` runs the same
measurement (`CALIBRATE`) on each case's own cluster right before the case:

- prefill: single requests one at a time (idle cluster), prompt t new tokens after a cached
  prefix c; the served TTFT of short prompts minus the engine's prefill step time is the
  first token's fixed delay (router, Ray and gRPC latency, which does not occupy the worker),
  and longer prompts say how far the engine profile's prefill has drifted since;
- decode: b equal streams at once, pinned to one decode (or colocated) worker while the others
  idle, the workers taking turns shape by shape; the mean gap between chunks while all b
  decode is the served decode step, fitted as d0 + d1*b + d2*context like the engine's; a
  lone stream's first gap, less one step and the transfer's last layer, is the KV hand-off
  (completion notice, the decode loop noticing it). One worker at a time, because streams on
  every worker at once carried the workers' mutual slow-down into every point (two workers
  and the router on two cores), while a light workload mostly decodes on one worker at a time;
  a neighbour's prefill, which does slow a worker, is measured apart (interference);
- busy admission: short prompts' TTFT while a decode stream runs, over an idle TTFT (the
  worker takes calls between steps, and its engine thread holds the GIL in between);
- interference: eight streams' gaps while another worker on the machine prefills long prompts,
  against their gaps otherwise (two workers on two cores slow each other down by tens of
  percent here: they share caches, memory bandwidth and, on this VM, probably a core).
"""
from __future__ import annotations

import asyncio
import random
import statistics

import numpy as np

from tqdm import tqdm

from dataclasses import replace

from loadgen.workloads import Workload, WorkloadRequest
from planning.fit import fit_decode, fit_prefill
from planning.latency import LatencyModel
from planning.load_run import LOAD_KEYS, apply_load, run_load

# `plan profile --serving`. decode_tokens: 32 prompts of 512 tokens reach the decode worker over
# ~1.2 s (4 per prefill step); with 60 tokens each the first streams had finished before the last began
# prefill: fresh prompts every 128 tokens from 256 to the longest the server takes (2,048, or
# max_model_len - 64: `fits`), so that the calibrated model passes through each (`calibrate`,
# LatencyModel.prefill_table; a few hundred ms each: seconds in all)
DENSE_PREFILL = tuple((t, 0) for t in range(256, 2049, 128))
FULL = {"prefill": ((16, 0), (128, 0)) + DENSE_PREFILL + ((128, 512), (512, 512)), "repeats": 3,
        "short_extra": 4, "batch": (1, 2, 4, 8, 16, 32), "ctx": (64, 512), "decode_tokens": 150,
        "long": ((1, 1536), (2, 1536)), "long_tokens": 150, "interference": True}
# what `plan validate` measures on each case's own cluster just before running it.
# `long`: (streams, context) shapes past the grid, `long_tokens` generated each. With contexts
# of 64 and 384 only, the fitted cost per context token (about 1 us on the AVX2 VM) was half of
# what a lone stream over 2,000 tokens paid, and the validation workload's long prompts decode
# alone at low load (two of its three over 1,200 tokens had their TPOT under-predicted by
# 25-35 %). One or two streams only: the prefill worker takes ~0.4 s per such prompt, so more
# streams would never all be decoding at once within a short generation.
CALIBRATE = {"prefill": ((16, 0), (64, 0)) + DENSE_PREFILL, "repeats": 2, "short_extra": 6,
             "batch": (1, 2, 4, 8), "ctx": (64, 384), "decode_tokens": 90, "long": ((1, 1536), (2, 1536)),
             "long_tokens": 150, "interference": True}
QUICK = {"prefill": ((16, 0), (128, 0), (256, 64)), "repeats": 2, "batch": (1, 2, 4), "ctx": (32,),
         "decode_tokens": 32}  # 12 left 4 staggered streams under 10 shared gaps
SHORT_PROMPT = 128   # served TTFTs of prompts up to this long give the first token's fixed delay
TABLE_MIN_LENGTHS = 6  # fresh served lengths past SHORT_PROMPT for the model to pass through each (calibrate)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _run(address: str, reqs: list[WorkloadRequest], concurrency: int | None):
    from loadgen.client import run_benchmark

    records, _, _ = asyncio.run(run_benchmark(address, Workload(reqs, 0, "serving-profile"),
                                              max_concurrency=concurrency, progress=False, run_tag="profile"))
    bad = [r for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"serving profile request failed: {bad[0].error} {getattr(bad[0], 'error_detail', '')}")
    return records


def fits(grid: dict, max_model_len: int) -> dict:
    """`grid` less the shapes the served model cannot take: a prompt must be shorter than
    max_model_len, and prompt plus generated tokens must fit in it. Where long prompts were
    dropped, the longest that fits is measured instead (the workload's long prompts are there)."""
    k = grid["decode_tokens"]
    prefill = [(t, c) for t, c in grid["prefill"] if t + c + 1 < max_model_len]
    longest = max_model_len - 64
    if len(prefill) < len(grid["prefill"]) and longest > max((t for t, c in prefill if c == 0), default=0):
        prefill.append((longest, 0))  # the longest prompt the context takes, in place of those dropped
    long_k = grid.get("long_tokens", k)
    out = dict(grid, prefill=tuple(prefill), ctx=tuple(L for L in grid["ctx"] if L + k < max_model_len),
               long=tuple((b, L) for b, L in grid.get("long", ()) if L + long_k < max_model_len))
    if not out["prefill"] or not out["ctx"]:
        raise ValueError(f"max_model_len={max_model_len} leaves no shape of the serving profile grid "
                         f"(prefill {grid['prefill']}, decode contexts {grid['ctx']} + {k} tokens)")
    return out


def measure_serving(address: str, vocab: int, max_model_len: int, grid: dict = FULL, seed: int = 1) -> dict:
    """Points measured against the router at `address`: prefill (t, c, served TTFT s) and
    decode (b, context, served step s) on one decode (or colocated) worker at a time, pinned
    by `GenerateRequest.decode_worker`. Shapes that do not fit `max_model_len` (the server's)
    are left out."""
    from loadgen.client import decode_worker_ids

    rng = random.Random(seed)
    grid = fits(grid, max_model_len)
    targets = asyncio.run(decode_worker_ids(address))
    if not targets:
        raise RuntimeError(f"the cluster at {address} reports no decode or colocated worker")
    prefill = []
    # one untimed round first, then the timed rounds shape after shape: a freshly started
    # cluster is still settling (in one calibration its 1,984-token prompts took 940 ms twice in
    # a row, the same prompts of the workload 640 ms minutes later), and repeats taken in rounds
    # rather than back to back spread a transient over every shape instead of one
    # plus `short_extra` more 16-token prompts per round: the first token's fixed delay and the
    # idle TTFT are medians of short prompts, and with two or four samples two calibrations of
    # the same case put the delay at 11.5 and 17.6 ms, as far apart as the TTFT errors they cause
    extra = [(16, 0)] * grid.get("short_extra", 0)
    rounds = [(r, t, c) for r in range(-1, grid["repeats"]) for t, c in grid["prefill"] + tuple(extra)]
    for r, t, c in tqdm(rounds, desc="served prefill", leave=False):
        prefix = _ids(rng, c, vocab)
        if c:
            _run(address, [WorkloadRequest(0, 0.0, c, 1, prompt_token_ids=prefix)], 1)
        ids = prefix + _ids(rng, t, vocab)
        rec = _run(address, [WorkloadRequest(0, 0.0, len(ids), 1, prompt_token_ids=ids)], 1)[0]
        if r >= 0:
            prefill.append((t, c, rec.ttft_s))
    decode, first_gaps = [], []
    shapes = [(b, L, grid["decode_tokens"]) for b in grid["batch"] for L in grid["ctx"]]
    shapes += [(b, L, grid.get("long_tokens", grid["decode_tokens"])) for b, L in grid.get("long", ())]
    for n, (b, L, k) in enumerate(tqdm(shapes, desc="served decode", leave=False)):
        target = targets[n % len(targets)]
        lengths = _spread(L, b, max_model_len - k - 2)
        reqs = [WorkloadRequest(i, 0.0, n_i, k, prompt_token_ids=_ids(rng, n_i, vocab), decode_worker=target)
                for i, n_i in enumerate(lengths)]
        recs = _run(address, reqs, None)
        point = _all_decoding(recs, lengths)
        if point is not None:
            decode.append(point)
        if b == 1:  # alone: first token -> second is transfer, hand-off, one step
            first_gaps.append((L, recs[0].itls_s[0]))
    interference = busy = None
    if grid.get("interference"):
        interference = measure_interference(address, vocab, rng, long_prompt=min(1536, max_model_len - 2),
                                            stream_on=targets[0], prefill_on=targets[-1])
        lone = [s for b, _, s in decode if b == 1]
        busy = measure_busy_ttft(address, vocab, rng, min(lone) if lone else 0.01, max_model_len)
    return {"prefill": prefill, "decode": decode, "first_gaps": first_gaps, "interference": interference,
            "busy_ttft": busy}


def merge_points(a: dict, b: dict) -> dict:
    """Two calibrations of one cluster as one set of points (`plan validate --bracket`): every
    timed sample of both, and the mean of their interference factors."""
    out = {k: list(a.get(k) or []) + list(b.get(k) or []) for k in ("prefill", "decode", "first_gaps", "busy_ttft")}
    factors = [p["factor"] for p in (a.get("interference"), b.get("interference")) if p]
    out["interference"] = {"factor": sum(factors) / len(factors), "each": [a.get("interference"),
                                                                          b.get("interference")]} if factors else None
    return out


def _spread(length: int, streams: int, longest: int) -> list[int]:
    """Prompt lengths of one decode shape: `streams` of them evenly from half to 1.5x `length`
    (capped at `longest`). Streams that decode together in a workload differ in length, and
    the torch backend runs one attention call per length bucket: on this VM two streams of 40
    and 360 tokens step 10 % slower than two of 200, four of 50-350 13 % slower than four of 200."""
    if streams == 1:
        return [min(length, longest)]
    return [min(max(round(length * (0.5 + i / (streams - 1))), 1), longest) for i in range(streams)]


def _all_decoding(recs, prompts: list[int], min_gaps: int = 10) -> tuple[int, int, float] | None:
    """(streams, summed context, served step) from the chunk gaps that fall while every stream
    decodes: from the last stream's second chunk (all prefills and hand-offs are over) to the
    first stream's last chunk. The mean, not the median: TPOT is a mean of gaps, and the
    occasional slow step (the process shares its core and GIL with output streaming) is part of
    it. None when that window holds fewer than `min_gaps` gaps: the streams' prefills were so
    staggered that they never all decoded together (a middle third of each stream's gaps would
    time one or two streams and call it 32: a 32 x 1,536 shape then comes out faster than 32 x 64)."""
    if any(len(r.chunk_times_s) < 3 for r in recs):
        return None
    lo = max(r.start_s + r.chunk_times_s[1] for r in recs)
    hi = min(r.start_s + r.chunk_times_s[-1] for r in recs)
    gaps, ctx = [], []
    for r, prompt in zip(recs, prompts):
        t = [r.start_s + c for c in r.chunk_times_s]
        for i in range(1, len(t) - 1):
            if lo <= t[i] and t[i + 1] <= hi:
                gaps.append(t[i + 1] - t[i])
                ctx.append(prompt + i + 1)
    if len(gaps) < min_gaps:
        return None
    b = len(recs)
    return b, round(b * statistics.fmean(ctx)), statistics.fmean(gaps)


def measure_busy_ttft(address: str, vocab: int, rng: random.Random, step_s: float, max_model_len: int,
                      prompt: int = 16, n: int = 12) -> list[float]:
    """TTFTs of short prompts sent while a decode stream runs. A worker takes calls (admit,
    submit) between its steps, on a process whose engine thread holds the GIL in between; the
    time this adds over an idle worker's TTFT shows here. `step_s` (a lone stream's served step)
    sizes the stream so that the prompts arrive while it decodes, and only prompts whose whole
    TTFT lies inside its decoding count. A 120-token stream ends after about a second while
    six prompts span two, so half of them would time an idle worker (two calibrations of the same
    case then put the busy delay at 7.1 and 0 ms)."""
    tokens = max(min(800, max_model_len - 64 - 8), 1)
    spacing = min(max((0.8 * tokens * step_s - 0.4) / n, 0.05), 0.25)
    reqs = [WorkloadRequest(0, 0.0, 64, tokens, prompt_token_ids=_ids(rng, 64, vocab))]
    reqs += [WorkloadRequest(1 + j, 0.4 + spacing * j, prompt, 1, prompt_token_ids=_ids(rng, prompt, vocab))
             for j in range(n)]
    records = _run(address, reqs, None)
    stream = records[0]
    lo, hi = stream.start_s + stream.ttft_s, stream.start_s + stream.chunk_times_s[-1]
    return [r.ttft_s for r in records[1:] if lo <= r.start_s and r.start_s + r.ttft_s <= hi]


def measure_interference(address: str, vocab: int, rng: random.Random, long_prompt: int = 1536,
                         stream_on: str = "", prefill_on: str = "", streams: int = 8) -> dict:
    """How much a worker's steps slow down while another worker on this machine is busy:
    `streams` decode streams run (on `stream_on`) while long prompts are prefilled elsewhere
    (by the prefill worker, or, colocated, by `prefill_on`); the streams' gaps ending inside a
    prefill's window against those outside. Returns {inside_s, outside_s, factor, gaps_inside,
    streams}. The streams outlast every window even at 10 ms a step (160 tokens against windows
    2.2 s apart left the factor resting on one prefill, 0.0 to 0.36 between runs). Eight
    streams, not one: on a 2-core VM a busy neighbour slows one stream by 0-19 % but a batch of
    eight by 1.3-1.7x (docs/notebook/2026-12-05-capacity-planning-validation-runs.md), and a
    loaded cluster decodes batches."""
    k = 400
    reqs = [WorkloadRequest(i, 0.0, 64, k, prompt_token_ids=_ids(rng, 64, vocab), decode_worker=stream_on)
            for i in range(streams)]
    longs = [WorkloadRequest(streams + j, 0.5 + 1.2 * j, long_prompt, 1,
                             prompt_token_ids=_ids(rng, long_prompt, vocab), decode_worker=prefill_on)
             for j in range(3)]
    records = _run(address, reqs + longs, None)
    windows = [(r.start_s, r.start_s + r.ttft_s) for r in records[streams:]]
    inside, outside = [], []
    for r in records[:streams]:
        t = [r.start_s + c for c in r.chunk_times_s]
        for a, b in zip(t[1:], t[2:]):  # skip the first gap (transfer, hand-off)
            (inside if any(lo <= b <= hi for lo, hi in windows) else outside).append(b - a)
    if not inside or not outside:
        return {"inside_s": None, "outside_s": None, "factor": 0.0}
    mi, mo = statistics.fmean(inside), statistics.fmean(outside)
    return {"inside_s": mi, "outside_s": mo, "factor": max(mi / mo - 1.0, 0.0), "gaps_inside": len(inside),
            "streams": streams}


def _reshaped_prefill(engine_lm: LatencyModel, curve: list[tuple[int, float]], p3: float) -> tuple:
    """p0..p2 refitted to the engine's prefill curve times the served/engine ratio measured at
    each served length (1 up to SHORT_PROMPT, interpolated in log length, held flat past the
    longest).
    The ratio drifts with length (on the AVX2 VM: ~1.3 at 512 tokens, ~1.0 at 1,024, ~0.75 at
    1,984, in every calibration), which one scale cannot follow; the refit sees a smooth curve,
    never the raw samples (refits on those followed their noise, or collapsed to zero)."""
    lengths = np.geomspace(16, curve[-1][0], 24)  # below SHORT_PROMPT np.interp holds the ratio at 1
    ratio = np.interp(np.log(lengths), np.log([t for t, _ in curve]), [r for _, r in curve])
    target = [(float(t), 0.0, engine_lm.prefill_time(float(t), 0) * r) for t, r in zip(lengths, ratio)]
    return fit_prefill(target).coef[:3] + (p3,)


def calibrate(engine_lm: LatencyModel, points: dict) -> tuple[LatencyModel, dict]:
    """The engine profile made to match the served points: decode refitted on the served
    steps; the first token's fixed delay from short prompts (served TTFT over the engine's
    prefill step); prefill scaled by how much slower (or faster) longer served prefills ran
    than the engine profile says, which absorbs drift of a shared machine since profiling.
    With two or more served lengths past SHORT_PROMPT, the engine fit is reshaped by the ratio
    at each of them (`_reshaped_prefill`)."""
    short = [ttft - engine_lm.prefill_time(t, c) for t, c, ttft in points["prefill"] if t <= SHORT_PROMPT]
    delay = max(statistics.median(short), 0.0) if short else 0.0
    ratios: dict[tuple[int, int], list[float]] = {}  # served / engine prefill, per measured shape
    for t, c, ttft in points["prefill"]:
        if t > SHORT_PROMPT:
            ratios.setdefault((t, c), []).append((ttft - delay) / engine_lm.prefill_time(t, c))
    scale = statistics.median([r for rs in ratios.values() for r in rs]) if ratios else 1.0
    prefill = tuple(p * scale for p in engine_lm.prefill)
    # short prompts set the delay so that their ratio is 1: the curve starts there
    curve = [(SHORT_PROMPT, 1.0)] + sorted((t, statistics.median(rs)) for (t, c), rs in ratios.items() if c == 0)
    if len(curve) >= 3:
        prefill = _reshaped_prefill(engine_lm, curve, prefill[3])
    # with a dense grid of served lengths (CALIBRATE's), the model passes through each (LatencyModel's
    # prefill_table): the measured time of one sequence, the served TTFT less the fixed delay
    fresh: dict[int, list[float]] = {}
    for t, c, ttft in points["prefill"]:
        if c == 0:
            fresh.setdefault(t, []).append(ttft - delay)
    table = tuple((t, statistics.median(v)) for t, v in sorted(fresh.items()))
    if sum(t > SHORT_PROMPT for t, _ in table) < TABLE_MIN_LENGTHS or any(v <= 0 for _, v in table):
        table = ()
    interference = (points.get("interference") or {}).get("factor", 0.0)
    fd = fit_decode(points["decode"])
    lm = replace(engine_lm, prefill=prefill, decode=tuple(fd.coef), prefill_table=table)
    handoffs = [gap - lm.decode_time(1, L + 1) - lm.transfer_time(L * lm.kv_bytes_per_token) / max(lm.num_layers, 1)
                for L, gap in points.get("first_gaps", ())]
    handoff = max(statistics.median(handoffs), 0.0) if handoffs else 0.0
    busy = points.get("busy_ttft") or []
    # over an idle worker's TTFT, less the wait for the current step to end (half a step on average)
    idle = [ttft for t, c, ttft in points["prefill"] if t == 16 and c == 0]
    busy_admit = max(statistics.median(busy) - statistics.median(idle) - lm.decode_time(1, 100) / 2, 0.0) \
        if busy and idle else 0.0
    info = {"decode_fit": fd.as_dict(), "first_token_delay_s": delay, "prefill_scale": scale,
            "prefill_table_lengths": len(table),
            "kv_handoff_s": handoff, "host_interference": interference, "busy_admit_s": busy_admit}
    # a load fit of an earlier calibration (a served profile's) does not carry over: it is
    # relative to the model that calibration made (apply_load fits this one's)
    inherited = {k: v for k, v in engine_lm.meta.items() if k not in LOAD_KEYS}
    lm = replace(lm, source=engine_lm.source.replace("profile:", "served:", 1),
                 meta=dict(inherited, served=True, engine_decode=list(engine_lm.decode),
                           **{k: v for k, v in info.items() if k != "decode_fit"}))
    return lm, info


def profile_serving(model: str, dtype: str, engine_lm: LatencyModel, quick: bool = False,
                    transport: str = "nixl", load_rate: float | None = None,
                    load_requests: int | None = None) -> tuple[LatencyModel, dict]:
    """Start a 1 prefill + 1 decode cluster here, measure, stop it: the calibrated model and
    {points, decode_fit, first_token_delay_s, prefill_scale, ...}; with `load_rate`, also a load
    run at that rate (`run_load`, `apply_load`: its fit under "load")."""
    from loadgen.client import model_info
    from cluster.config import ClusterConfig
    from cluster.runtime import Cluster

    cfg = ClusterConfig.embedded(model=model, prefill=1, decode=1, transport=transport, port=0,
                                 engine={"dtype": dtype})
    cluster = Cluster(cfg)
    address = cluster.start()
    load_result = None
    try:
        served = asyncio.run(model_info(address))
        points = measure_serving(address, served.vocab_size, served.max_model_len, QUICK if quick else FULL)
        if load_rate:
            load_result = run_load(address, served.vocab_size, served.max_model_len, load_rate, seed=3000,
                                   num_requests=load_requests)
    finally:
        cluster.stop()
    lm, info = calibrate(engine_lm, points)
    out = {"points": points, **info}
    if load_result is not None:
        lm, out["load"] = apply_load(lm, cfg, *load_result, max_model_len=served.max_model_len)
    return lm, out
