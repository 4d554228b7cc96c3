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

from bench.serve.workloads import Workload, WorkloadRequest
from cluster.planning.fit import fit_decode, fit_prefill
from cluster.planning.latency import LatencyModel

# `plan profile --serving`. decode_tokens: 32 prompts of 512 tokens reach the decode worker over
# ~1.2 s (4 per prefill step); with 60 tokens each the first streams had finished before the last began
FULL = {"prefill": ((16, 0), (128, 0), (512, 0), (1024, 0), (2048, 0), (128, 512), (512, 512)), "repeats": 3,
        "short_extra": 4, "batch": (1, 2, 4, 8, 16, 32), "ctx": (64, 512), "decode_tokens": 150,
        "long": ((1, 1536), (2, 1536)), "long_tokens": 150, "interference": True}
# what `plan validate` measures on each case's own cluster just before running it.
# `long`: (streams, context) shapes past the grid, `long_tokens` generated each. With contexts
# of 64 and 384 only, the fitted cost per context token (about 1 us on the AVX2 VM) was half of
# what a lone stream over 2,000 tokens paid, and the validation workload's long prompts decode
# alone at low load (two of its three over 1,200 tokens had their TPOT under-predicted by
# 25-35 %). One or two streams only: the prefill worker takes ~0.4 s per such prompt, so more
# streams would never all be decoding at once within a short generation.
CALIBRATE = {"prefill": ((16, 0), (64, 0), (512, 0), (1024, 0), (2048, 0)), "repeats": 2, "short_extra": 6,
             "batch": (1, 2, 4, 8), "ctx": (64, 384), "decode_tokens": 90, "long": ((1, 1536), (2, 1536)),
             "long_tokens": 150, "interference": True}
QUICK = {"prefill": ((16, 0), (128, 0), (256, 64)), "repeats": 2, "batch": (1, 2, 4), "ctx": (32,),
         "decode_tokens": 32}  # 12 left 4 staggered streams under 10 shared gaps
SHORT_PROMPT = 128   # served TTFTs of prompts up to this long give the first token's fixed delay


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _run(address: str, reqs: list[WorkloadRequest], concurrency: int | None):
    from bench.serve.client import run_benchmark

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
    from bench.serve.client import decode_worker_ids

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
    # idle TTFT are medians of short prompts, and with two or four samples the fifth validation
    # run's calibrations of the same case put the delay at 11.5 and 17.6 ms, as far apart as
    # the TTFT errors they caused
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
    staggered that they never all decoded together (a middle third of each stream's gaps, used
    before, then timed one or two streams and called it 32: a 32 x 1,536 shape came out faster
    than 32 x 64)."""
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
    TTFT lies inside its decoding count. Before, a 120-token stream ended after about a second
    while six prompts spanned two, so half of them timed an idle worker and two calibrations of
    the same case put the busy delay at 7.1 and 0 ms."""
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
    streams, not one: on the 2-core VM a busy neighbour slowed one stream by 0-19 % but a batch
    of eight by 1.3-1.7x (docs/capacity-planning.md), and a loaded cluster decodes batches."""
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


# the synthetic load run of `plan validate` (fit_load): Poisson arrivals at the case's rate for
# about `duration_s`, prompts and outputs uniform in these ranges (the validation trace's prompts
# are mostly 200-1,000 tokens, its outputs 10-150: the same regime, never its requests)
LOAD = {"input_range": (128, 1024), "output_range": (16, 128), "duration_s": 60.0, "min_requests": 24}
LOAD_KEYS = ("load_same", "load_other", "load_rate")  # what apply_load adds to a model's meta


def load_workload(rate: float, max_model_len: int, seed: int, num_requests: int | None = None,
                  grid: dict = LOAD, like: Workload | None = None) -> Workload:
    """Requests arriving as a Poisson process at `rate`, for the load run. Lengths uniform in
    `grid`'s ranges, or, with `like` (the workload to be predicted), drawn from log-normal
    distributions with the mean and spread of its log prompt and output lengths: its input and
    output length distribution, as Dynamo's profiler takes the target ISL/OSL, never its
    requests. The fit depends on where the lengths lie: with uniform 128-1,024-token prompts (the
    fourteenth validation run) a quiet prompt's extra delay was read off prompts three times the
    replayed trace's median length (185 tokens): 8-15 ms, where the replay's prompts paid ~5.
    Held-out requests of the same trace do not match it either (past its first 1,000 the Azure
    conversation trace's prompts have a median of 520 tokens, outputs twice as long)."""
    from bench.serve.workloads import WorkloadRequest, build_workload, gamma_arrivals

    if not rate > 0:
        raise ValueError(f"the load run needs a request rate > 0, got {rate}")
    n = num_requests or max(grid["min_requests"], round(rate * grid["duration_s"]))
    if like is not None and like.requests:
        rng = np.random.default_rng(seed)

        def draw(lengths: list[int], hi: int) -> np.ndarray:
            logs = np.log(np.maximum(np.asarray(lengths, dtype=float), 1.0))
            return np.clip(np.round(np.exp(rng.normal(logs.mean(), logs.std(), n))), 1, hi).astype(int)

        outs = draw([r.output_len for r in like.requests], max(max_model_len // 4, 1))
        prompts = draw([r.prompt_len for r in like.requests], max_model_len)
        prompts = np.minimum(prompts, np.maximum(max_model_len - outs - 2, 1))
        reqs = [WorkloadRequest(i, t, int(p), int(o))
                for i, (t, p, o) in enumerate(zip(gamma_arrivals(n, rate, 1.0, seed), prompts, outs))]
        return Workload(reqs, 0, f"load-like-{like.name}", meta={"request_rate": rate, "burstiness": 1.0})
    lo_out, hi_out = grid["output_range"]
    hi_in = max(min(grid["input_range"][1], max_model_len - hi_out - 2), 1)
    lo_in = min(grid["input_range"][0], hi_in)
    return build_workload("random", num_requests=n, request_rate=rate, seed=seed, input_range=(lo_in, hi_in),
                          output_range=(lo_out, hi_out))


def _decode_window(m: dict) -> tuple[float, float]:
    a = m["start_s"] + m["ttft_s"]
    return a, a + m["tpot_s"] * (m["output_tokens"] - 1)


def _streams_during(recs: list[dict], a: float, b: float, worker, same: bool) -> float:
    """Streams decoding in [a, b], time-averaged, on `worker` (same) or on any other worker."""
    n = 0.0
    for o in recs:
        if (o["server"].get("decode_worker") == worker) == same:
            lo, hi = _decode_window(o)
            n += max(0.0, min(b, hi) - max(a, lo))
    return n / (b - a)


def compact_record(r) -> dict:
    """What comparing a prediction with a measurement needs of one request record, both sides alike."""
    gaps = r.itls_s
    return {"index": r.index, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "ok": r.ok,
            "start_s": r.start_s, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "first_gap_s": gaps[0] if gaps else None,
            "mean_later_gap_s": sum(gaps[1:]) / len(gaps[1:]) if len(gaps) > 1 else None,
            "server": {k: v for k, v in r.server.items() if isinstance(v, (int, float, str, bool))}}


def run_load(address: str, vocab: int, max_model_len: int, rate: float, seed: int,
             num_requests: int | None = None, **lengths) -> tuple[Workload, list]:
    """Serve the load run (`load_workload`; `lengths`: its `like`) on the cluster at `address`:
    its workload and the client's records."""
    from bench.serve.client import run_benchmark
    from bench.serve.workloads import materialize_prompts

    wl = load_workload(rate, max_model_len, seed=seed, num_requests=num_requests, **lengths)
    materialize_prompts(wl, vocab, seed=seed + 1000)
    records, _, _ = asyncio.run(run_benchmark(address, wl, progress=False, run_tag="load"))
    return wl, records


def apply_load(lm: LatencyModel, cfg, workload: Workload, records: list, max_model_len: int) -> tuple:
    """The calibrated model `lm` of the cluster `cfg` (a ClusterConfig) with the load run's fit
    in its meta (read by the simulator): the load workload simulated with `lm`, compared request
    by request with `records` (`fit_load`). Returns (model, fit)."""
    from cluster.planning.sim_config import sim_cluster
    from cluster.planning.simulator import simulate

    lm = replace(lm, meta={k: v for k, v in lm.meta.items() if k not in LOAD_KEYS})  # fit against the bare model
    sim = simulate(sim_cluster(cfg, profile=lm, max_model_len=max_model_len), workload)
    delay = lm.meta.get("first_token_delay_s", 0.0)
    fit = fit_load([compact_record(r) for r in records], [compact_record(r) for r in sim.records],
                   first_token_delay_s=delay)
    meta = dict(lm.meta, load_same=fit["load_same"], load_other=fit["load_other"],
                first_token_delay_s=delay + fit["ttft_offset_s"], load_rate=workload.meta.get("request_rate"))
    return replace(lm, meta=meta), fit


def fit_load(measured: list[dict], predicted: list[dict], first_token_delay_s: float = 0.0,
             min_tokens: int = 8) -> dict:
    """What a staggered load costs beyond the calibrated model, from one run of synthetic
    requests: measured (what the client saw) and predicted (the simulator with the calibrated
    model, the same requests), each request as `validate._compact` gives it.

    The calibration times b streams that start together on an otherwise idle cluster, and
    prefills one at a time. Under a Poisson load streams join and leave a running batch one by
    one, each arrival bringing a prefill, a KV hand-off and admissions while the others step,
    and the workers, router and client share the host's cores. In the thirteenth validation run
    (docs/capacity-planning.md) a lone stream was predicted right (measured / predicted mean gap
    0.98-1.04) and each further stream decoding at the same time added 0.26-0.31; a prompt
    prefilled while streams decoded elsewhere took ~0.3 x its prefill longer per such stream,
    and one prefilled on a quiet host still ~5 ms longer than predicted. Fitted here:

    - load_same: per request of at least `min_tokens` outputs, measured / predicted mean later
      gap - 1 = load_same x (streams decoding on its worker - 1) + load_other x (streams
      decoding on other workers), stream counts time-averaged over its decoding window, least
      squares through the origin (a lone stream is what the calibration measured);
    - load_other: the mean of that fit's term (where some request had a neighbour decode) and
      the TTFT fit's: measured - predicted TTFT - ttft_offset = load_other x (predicted TTFT -
      first_token_delay_s) x (streams decoding on other workers during it);
    - ttft_offset_s: the median of measured - predicted TTFT over requests no stream decoded
      beside (what the first token's path costs under the load's arrivals, over the idle
      calibration's), added to the first-token delay.
    All clipped at 0 (the offset at -first_token_delay_s)."""
    pred = {p["index"]: p for p in predicted if p.get("ok")}
    recs = [m for m in measured if m.get("ok") and m["output_tokens"] >= 2]
    gaps, ttfts = [], []
    for m in measured:
        p = pred.get(m["index"])
        if not m.get("ok") or not p:
            continue
        worker = m["server"].get("decode_worker")
        prefilled_on = m["server"].get("prefill_worker") or worker  # colocated: the server leaves it empty
        a, b = m["start_s"], m["start_s"] + m["ttft_s"]
        if b > a:
            others = [o for o in recs if o is not m]
            beside = _streams_during(others, a, b, prefilled_on, same=False)
            here = _streams_during(others, a, b, prefilled_on, same=True)
            ttfts.append((beside, here, max(p["ttft_s"] - first_token_delay_s, 0.0), m["ttft_s"] - p["ttft_s"]))
        if m["output_tokens"] < min_tokens or not p.get("mean_later_gap_s") or not m.get("mean_later_gap_s"):
            continue
        a, b = _decode_window(m)
        if b > a:
            gaps.append((_streams_during(recs, a, b, worker, same=True) - 1.0,
                         _streams_during(recs, a, b, worker, same=False),
                         m["mean_later_gap_s"] / p["mean_later_gap_s"] - 1.0))
    out = {"load_same": 0.0, "load_other": 0.0, "ttft_offset_s": 0.0, "requests": len(gaps)}
    other = []
    if len(gaps) >= 4:
        g = np.asarray(gaps, dtype=float)
        cols = [0] + ([1] if np.any(g[:, 1] > 0.05) else [])
        coef, *_ = np.linalg.lstsq(g[:, cols], g[:, 2], rcond=None)
        out["load_same"] = max(float(coef[0]), 0.0)
        if len(cols) > 1:
            other.append(max(float(coef[1]), 0.0))
        out.update(mean_ratio=float(1.0 + g[:, 2].mean()), mean_streams_same=float(1.0 + g[:, 0].mean()),
                   mean_streams_other=float(g[:, 1].mean()))
    quiet = [d for beside, here, _, d in ttfts if beside + here < 0.3]
    if len(quiet) >= 4:
        out["ttft_offset_s"] = max(float(statistics.median(quiet)), -first_token_delay_s)
    busy = [(beside * prefill, d - out["ttft_offset_s"]) for beside, _, prefill, d in ttfts if beside >= 0.3]
    if len(busy) >= 3 and any(x > 0 for x, _ in busy):
        x, y = np.asarray(busy, dtype=float).T
        other.append(max(float(x @ y / (x @ x)), 0.0))
        out["load_other_ttft"] = other[-1]
    if other:
        out["load_other"] = float(np.mean(other))
    out["ttft_requests"] = len(ttfts)
    return out


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
    interference = (points.get("interference") or {}).get("factor", 0.0)
    fd = fit_decode(points["decode"])
    lm = replace(engine_lm, prefill=prefill, decode=tuple(fd.coef))
    handoffs = [gap - lm.decode_time(1, L + 1) - lm.transfer_time(L * lm.kv_bytes_per_token) / max(lm.num_layers, 1)
                for L, gap in points.get("first_gaps", ())]
    handoff = max(statistics.median(handoffs), 0.0) if handoffs else 0.0
    busy = points.get("busy_ttft") or []
    # over an idle worker's TTFT, less the wait for the current step to end (half a step on average)
    idle = [ttft for t, c, ttft in points["prefill"] if t == 16 and c == 0]
    busy_admit = max(statistics.median(busy) - statistics.median(idle) - lm.decode_time(1, 100) / 2, 0.0) \
        if busy and idle else 0.0
    info = {"decode_fit": fd.as_dict(), "first_token_delay_s": delay, "prefill_scale": scale,
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
    from bench.serve.client import model_info
    from cluster.config import ClusterConfig
    from cluster.runtime import Cluster

    cfg = ClusterConfig.embedded(model=model, prefill=1, decode=1, transport=transport, port=0,
                                 engine={"dtype": dtype})
    cluster = Cluster(cfg)
    address = cluster.start()
    load_run = None
    try:
        served = asyncio.run(model_info(address))
        points = measure_serving(address, served.vocab_size, served.max_model_len, QUICK if quick else FULL)
        if load_rate:
            load_run = run_load(address, served.vocab_size, served.max_model_len, load_rate, seed=3000,
                                num_requests=load_requests)
    finally:
        cluster.stop()
    lm, info = calibrate(engine_lm, points)
    out = {"points": points, **info}
    if load_run is not None:
        lm, out["load"] = apply_load(lm, cfg, *load_run, max_model_len=served.max_model_len)
    return lm, out
