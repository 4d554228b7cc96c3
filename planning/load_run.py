"""The load run: what a staggered load costs beyond the serving calibration.

`serving_profile` times controlled shapes on an idle cluster: b streams that start together,
prompts one at a time. Under Poisson arrivals streams join and leave running batches one by
one, prompts are prefilled beside decoding streams, and the workers, router and client share
the host's cores. The load run serves requests at a workload's rate on the same cluster
(`run_load`), the simulator predicts the same requests with the calibrated model, and
`fit_load` reads from the differences, request by request, per-stream slow-down factors and a
first-token offset (`fit_samples`: the same over several load runs, pooled), which `with_load`
puts into the model's meta for the simulator (`SimCluster.load_same`, `load_other`;
docs/capacity-planning.md). `apply_load` does all of it for one load run.
"""
from __future__ import annotations

import asyncio
import statistics
from dataclasses import replace

import numpy as np

from loadgen.workloads import Workload
from planning.latency import LatencyModel

# the load run's defaults: Poisson arrivals for about `duration_s` (at least `min_requests`);
# without a workload to follow (`plan profile --load-rate`), prompts and outputs uniform in these
# ranges; `plan validate` follows the case's length distribution instead (load_workload)
LOAD = {"input_range": (128, 1024), "output_range": (16, 128), "duration_s": 60.0, "min_requests": 24}
# requests that decoded alone (no other stream on any worker) before the gap fit gets an intercept
MIN_LONE_STREAMS = 8
LOAD_KEYS = ("load_base", "load_same", "load_other", "load_other_prefill", "load_rate")  # what with_load puts in meta


def load_workload(rate: float, max_model_len: int, seed: int, num_requests: int | None = None,
                  grid: dict = LOAD, like: Workload | None = None) -> Workload:
    """Requests arriving as a Poisson process at `rate`, for the load run. Lengths uniform in
    `grid`'s ranges, or, with `like` (the workload to be predicted), drawn from log-normal
    distributions with the mean and spread of its log prompt and output lengths: its input and
    output length distribution, as Dynamo's profiler takes the target ISL/OSL, never its
    requests. The fit depends on where the lengths lie: uniform 128-1,024-token prompts are three
    times the replayed trace's median length (185 tokens), and the quiet prompt's extra delay read
    off them, 8-15 ms, overshoots the ~5 ms the replay's prompts pay.
    Held-out requests of the same trace do not match it either (past its first 1,000 the Azure
    conversation trace's prompts have a median of 520 tokens, outputs twice as long)."""
    from loadgen.workloads import WorkloadRequest, build_workload, gamma_arrivals

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
    from loadgen.client import run_benchmark
    from loadgen.workloads import materialize_prompts

    wl = load_workload(rate, max_model_len, seed=seed, num_requests=num_requests, **lengths)
    materialize_prompts(wl, vocab, seed=seed + 1000)
    records, _, _ = asyncio.run(run_benchmark(address, wl, progress=False, run_tag="load"))
    return wl, records


def apply_load(lm: LatencyModel, cfg, workload: Workload, records: list, max_model_len: int) -> tuple:
    """The calibrated model `lm` of the cluster `cfg` (a ClusterConfig) with the load run's fit
    in its meta (read by the simulator): the load workload simulated with `lm`, compared request
    by request with `records` (`fit_load`). Returns (model, fit)."""
    fit = fit_samples([load_samples(lm, cfg, workload, records, max_model_len)])
    return with_load(lm, fit, workload.meta.get("request_rate")), fit


def load_samples(lm: LatencyModel, cfg, workload: Workload, records: list, max_model_len: int) -> dict:
    """One load run's samples for `fit_samples`: its workload simulated on the cluster `cfg`
    with the calibrated model `lm` (any load fit it carries dropped: the fit is relative to the
    bare model), compared request by request with the client's `records`."""
    lm = replace(lm, meta={k: v for k, v in lm.meta.items() if k not in LOAD_KEYS})
    return request_samples([compact_record(r) for r in records], _predicted(lm, cfg, workload, max_model_len),
                           first_token_delay_s=lm.meta.get("first_token_delay_s", 0.0))


def load_residuals(lm: LatencyModel, cfg, workload: Workload, records: list, max_model_len: int) -> dict:
    """What the load run's requests vary by beyond the model `lm` (calibrated, carrying its load
    fit): the workload simulated with it and compared with the client's `records`, request by
    request (`dispersion.residuals`)."""
    from planning.dispersion import residuals

    return residuals([compact_record(r) for r in records], _predicted(lm, cfg, workload, max_model_len))


def _predicted(lm: LatencyModel, cfg, workload: Workload, max_model_len: int) -> list[dict]:
    """The load workload simulated on the cluster `cfg` with `lm`, as `compact_record` dicts."""
    from planning.sim_config import sim_cluster
    from planning.simulator import simulate

    sim = simulate(sim_cluster(cfg, profile=lm, max_model_len=max_model_len), workload)
    return [compact_record(r) for r in sim.records]


def with_load(lm: LatencyModel, fit: dict, rate: float | None) -> LatencyModel:
    """`lm` (calibrated, without a load fit) carrying `fit` for the simulator."""
    meta = {k: v for k, v in lm.meta.items() if k not in LOAD_KEYS}
    delay = meta.get("first_token_delay_s", 0.0)
    meta.update(load_base=fit.get("load_base", 0.0), load_same=fit["load_same"], load_other=fit["load_other"],
                load_other_prefill=fit.get("load_other_prefill", fit["load_other"]),
                first_token_delay_s=max(delay + fit["ttft_offset_s"], 0.0), load_rate=rate)
    return replace(lm, meta=meta)


def fit_load(measured: list[dict], predicted: list[dict], first_token_delay_s: float = 0.0,
             min_tokens: int = 8) -> dict:
    """What a staggered load costs beyond the calibrated model, from one run of synthetic
    requests: measured (what the client saw) and predicted (the simulator with the calibrated
    model, the same requests), each request as `compact_record` gives it.

    The calibration times b streams that start together on an otherwise idle cluster, and
    prefills one at a time. Under a Poisson load streams join and leave a running batch one by
    one, each arrival bringing a prefill, a KV hand-off and admissions while the others step,
    and the workers, router and client share the host's cores. On a 2-core EPYC VM a lone stream
    is predicted right (measured / predicted mean gap 0.98-1.04) and each further stream decoding
    at the same time adds 0.26-0.31; a prompt prefilled while streams decode elsewhere takes
    ~0.3 x its prefill longer per such stream, and one prefilled on a quiet host still ~5 ms
    longer than predicted (docs/notebook/2026-12-05-capacity-planning-validation-runs.md).
    Fitted here:

    - load_same: per request of at least `min_tokens` outputs, measured / predicted mean later
      gap - 1 = load_base + load_same x (streams decoding on its worker - 1) + load_other x
      (streams decoding on other workers), stream counts time-averaged over its decoding window,
      least squares;
    - load_base: that fit's intercept, what a stream decoding alone pays under the load's
      arrivals over the idle calibration (prompts prefilled beside it, the router and client
      busy with other requests), fitted where at least MIN_LONE_STREAMS requests decoded alone,
      else 0 (the fit goes through the origin). Lone streams are predicted right on the EPYC VM
      (0.98-1.04), but on a 2-core Xeon they run 7.5 % over the calibration on average while
      streams alongside add nothing in 1P+1D (-0.04 per stream with the intercept, +0.04
      without): through the origin, TPOT comes out 3-4 % under at every length;
    - load_other: that fit's term (where some request had a neighbour decode): what a decode
      step pays per stream a neighbour decodes;
    - load_other_prefill: the TTFT fit's: measured - predicted TTFT - ttft_offset =
      load_other_prefill x (predicted TTFT - first_token_delay_s) x (streams decoding on other
      workers during it): what a step that prefills pays. Each stands in for the other where
      only one could be fitted (a disaggregated decode worker has no decoding neighbour). Not
      one factor, their mean: a colocated case can have a TTFT term of 0.53 against a gap term
      of 0.22, and the mean would slow every decode step next to a decoding neighbour by 0.37
      per stream: TPOT p90 +24 % (docs/notebook/2026-12-06-capacity-planning-validation-runs.md);
    - ttft_offset_s: the median of measured - predicted TTFT over requests no stream decoded
      beside (what the first token's path costs under the load's arrivals, over the idle
      calibration's), added to the first-token delay.
    The factors clipped at 0. The same fit over several load runs: `fit_samples`."""
    return fit_samples([request_samples(measured, predicted, first_token_delay_s, min_tokens)])


def request_samples(measured: list[dict], predicted: list[dict], first_token_delay_s: float = 0.0,
                    min_tokens: int = 8) -> dict:
    """What `fit_samples` fits, from one load run (arguments as `fit_load`'s): per request of at
    least `min_tokens` outputs (streams on its worker - 1, streams on others, measured /
    predicted mean later gap - 1) under "gaps"; per request (streams decoding on other workers,
    streams on its own, predicted prefill, measured - predicted TTFT) under "ttfts". Stream
    counts are time-averaged over the request's decoding window, or its TTFT."""
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
    return {"gaps": gaps, "ttfts": ttfts}


def fit_samples(samples: list[dict]) -> dict:
    """The load fit (`fit_load`) over the samples of one or more load runs (`request_samples`),
    pooled: several runs of the same cluster shape at the same rate fit one set of factors on
    more requests than any of them."""
    gaps = [g for s in samples for g in s["gaps"]]
    ttfts = [t for s in samples for t in s["ttfts"]]
    out = {"load_base": 0.0, "load_same": 0.0, "load_other": 0.0, "ttft_offset_s": 0.0, "requests": len(gaps),
           "runs": len(samples)}
    gap_other = ttft_other = None
    if len(gaps) >= 4:
        g = np.asarray(gaps, dtype=float)
        cols = [0] + ([1] if np.any(g[:, 1] > 0.05) else [])
        lone = int(np.sum((g[:, 0] < 0.1) & (g[:, 1] < 0.1)))
        # an intercept (load_base) where enough streams decoded alone to pin it down
        base = lone >= MIN_LONE_STREAMS
        x = np.column_stack(([np.ones(len(g))] if base else []) + [g[:, c] for c in cols])
        coef, *_ = np.linalg.lstsq(x, g[:, 2], rcond=None)
        if base:
            out["load_base"] = max(float(coef[0]), -0.5)
            coef = coef[1:]
        out["load_same"] = max(float(coef[0]), 0.0)
        if len(cols) > 1:
            gap_other = out["load_other_gap"] = max(float(coef[1]), 0.0)
        out["lone_streams"] = lone
        out.update(mean_ratio=float(1.0 + g[:, 2].mean()), mean_streams_same=float(1.0 + g[:, 0].mean()),
                   mean_streams_other=float(g[:, 1].mean()))
    quiet = [d for beside, here, _, d in ttfts if beside + here < 0.3]
    if len(quiet) >= 4:
        out["ttft_offset_s"] = float(statistics.median(quiet))
    busy = [(beside * prefill, d - out["ttft_offset_s"]) for beside, _, prefill, d in ttfts if beside >= 0.3]
    if len(busy) >= 3 and any(x > 0 for x, _ in busy):
        x, y = np.asarray(busy, dtype=float).T
        ttft_other = out["load_other_ttft"] = max(float(x @ y / (x @ x)), 0.0)
    out["load_other"] = gap_other if gap_other is not None else (ttft_other or 0.0)
    out["load_other_prefill"] = ttft_other if ttft_other is not None else out["load_other"]
    out["ttft_requests"] = len(ttfts)
    return out
