"""What one request's latency varies by beyond the model, and what that does to percentiles.

The simulator gives each request one TTFT and one TPOT: what the calibrated model expects of
it. A served request on a shared machine lands somewhere around that, and not the same way
twice: in `plan validate`'s repeats on a 2-core VM the same request, replayed with the same
arrivals, has its TPOT vary by ~13 % (standard deviation of the log, after each run's level is
taken out), whatever its length, and the requests with the slowest measured TPOT are only half
of the ones predicted slowest (docs/notebook/2026-12-06-capacity-planning-validation-runs.md).
A percentile of the predictions is then not the expected percentile of a run: spreading every
request by its own draw widens the distribution, so the p90 of a run lies above the p90 of the
expectations (the 90th of 80 draws is mostly the upper tail of noise around the middle values),
and the p50 of a gappy distribution moves into its gaps.

The load run gives that spread without touching the workload: its synthetic requests, simulated
with the fitted model, against what the client measured (`residuals`). Per load run, the log of
measured / predicted per request, less the run's own centre (the level is the calibration's
business, the spread is what is left): TPOT centred on the mean ratio (decode steps are
calibrated on mean gaps), TTFT on the median (the first token's delay and the prefill drift are
medians). `expected_stats` then draws one residual per request, `draws` times, and averages
each statistic over the draws: the expected figure of one run of the workload.
"""
from __future__ import annotations

import math
import statistics

import numpy as np

DRAWS = 400


def residuals(measured: list[dict], predicted: list[dict], min_tokens: int = 8) -> dict:
    """One load run's residuals, centred (see the module doc): {"ttft": [...], "tpot": [...]},
    logs of measured / predicted, per request both sides completed (`compact_record` dicts).
    TPOT from the mean gap after the first (the first is the KV hand-off), for requests of at
    least `min_tokens` outputs."""
    pred = {p["index"]: p for p in predicted if p.get("ok")}
    ttft, tpot = [], []
    for m in measured:
        p = pred.get(m["index"])
        if not m.get("ok") or p is None:
            continue
        if m.get("ttft_s") and p.get("ttft_s"):
            ttft.append(math.log(m["ttft_s"] / p["ttft_s"]))
        if m["output_tokens"] >= min_tokens and m.get("mean_later_gap_s") and p.get("mean_later_gap_s"):
            tpot.append(math.log(m["mean_later_gap_s"] / p["mean_later_gap_s"]))
    out = {"ttft": [], "tpot": []}
    if ttft:
        c = statistics.median(ttft)
        out["ttft"] = [x - c for x in ttft]
    if tpot:
        c = statistics.fmean(tpot)
        out["tpot"] = [x - c for x in tpot]
    return out


def pool(runs: list[dict]) -> dict:
    """Several load runs' residuals as one set; the TPOT residuals re-centred so that their
    ratios average 1 (per-run centring is on the mean log, which a ratio's mean exceeds)."""
    ttft = [x for r in runs for x in r["ttft"]]
    tpot = [x for r in runs for x in r["tpot"]]
    if tpot:
        c = math.log(statistics.fmean(math.exp(x) for x in tpot))
        tpot = [x - c for x in tpot]
    return {"ttft": ttft, "tpot": tpot}


def describe(disp: dict) -> dict:
    """What goes into the JSON: how many residuals and their spread (standard deviation of the log)."""
    return {k: {"n": len(v), "sd": float(np.std(v)) if v else 0.0} for k, v in disp.items()}


def expected_stats(values_ms: list[float], log_residuals: list[float], percentiles=(50, 90, 99),
                   draws: int = DRAWS, seed: int = 0) -> dict:
    """`_stats_ms`-shaped figures (mean, median, p<q>) of `values_ms` with each value times
    exp(a residual drawn at random), averaged over `draws` draws. Without residuals, the plain
    figures."""
    v = np.asarray(values_ms, dtype=float)
    out: dict = {"count": len(v)}
    if not len(v):
        return out
    if log_residuals:
        rng = np.random.default_rng(seed)
        r = np.asarray(log_residuals, dtype=float)
        samples = v * np.exp(rng.choice(r, size=(draws, len(v))))
    else:
        samples = v[None, :]
    out["mean"] = float(samples.mean(axis=1).mean())
    out["median"] = float(np.median(samples, axis=1).mean())
    for q in percentiles:
        out[f"p{q:g}"] = float(np.percentile(samples, q, axis=1).mean())
    return out


def disperse_summary(summary: dict, records: list, disp: dict, draws: int = DRAWS, seed: int = 0) -> dict:
    """`summary` (loadgen.metrics.summarize of simulated `records`) with its TTFT and TPOT
    figures replaced by their expectation over per-request residual draws (`expected_stats`);
    the simulator's own figures stay under "deterministic"."""
    done = [r for r in records if r.ok]
    pct = tuple(summary.get("percentiles", (50, 90, 99)))
    out = dict(summary)
    out["deterministic"] = {k: summary[k] for k in ("ttft_ms", "tpot_ms")}
    for key, vals, res, salt in (
            ("ttft_ms", [r.ttft_s * 1e3 for r in done if r.ttft_s is not None], disp.get("ttft", []), 1),
            ("tpot_ms", [r.tpot_s * 1e3 for r in done if r.tpot_s is not None], disp.get("tpot", []), 2)):
        stats = expected_stats(vals, res, pct, draws, seed + salt)
        out[key] = dict(summary[key], **{k: v for k, v in stats.items() if k != "count"})
    out["dispersion"] = describe(disp)
    return out
