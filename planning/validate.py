"""Check the simulator against the real cluster on this machine.

For each case (a cluster shape and a workload that run here): start the real cluster (local
Ray on 127.0.0.1), calibrate the profile on it with synthetic requests (served decode steps,
the first token's fixed delay, prefill drift since profiling: a shared machine drifts by tens
of percent within minutes), simulate the case with that model, then replay the same workload
with `bench serve`'s client and compare the figures users read: TTFT p50/p90, TPOT p50/p90,
request and output throughput. The relative error is predicted / measured - 1.

Both sides get exactly the same requests (same trace slice, scaling, arrival times and seeds);
prompts get fresh tokens per case, so no case hits the prefix cache another case left. The
predicted TTFT and TPOT figures are what one run is expected to show: the simulator's
per-request latencies spread by what the case's load runs varied beyond the fitted model
(`dispersion.py`), since a percentile of expectations is not the expected percentile of a run.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from loadgen.metrics import summarize
from loadgen.workloads import Workload, build_workload, materialize_prompts
from planning.latency import LatencyModel
from planning.load_run import (compact_record, fit_samples, load_residuals, load_samples, run_load,
                                        with_load)

FIGURES = (("ttft", "median"), ("ttft", "p90"), ("tpot", "median"), ("tpot", "p90"),
           ("request_throughput", None), ("output_throughput", None))
TARGET = 0.10


@dataclass(slots=True)
class Case:
    name: str
    mode: str = "disaggregated"       # or colocated
    prefill: int = 1
    decode: int = 1                   # colocated: the number of workers
    dataset: str = "azure-conv"
    num_requests: int = 40
    request_rate: float = 0.5         # Poisson arrivals at this rate
    length_scale: float = 0.5
    seed: int = 0

    def describe(self) -> str:
        shape = f"{self.decode} colocated" if self.mode == "colocated" else f"{self.prefill}P+{self.decode}D"
        return (f"{shape}, {self.dataset} x{self.length_scale:g} lengths, {self.num_requests} requests at "
                f"{self.request_rate:g} req/s")


CASES: dict[str, Case] = {c.name: c for c in (
    Case("disagg-low", request_rate=0.4),
    Case("disagg-high", request_rate=0.8),
    Case("colocated", mode="colocated", decode=2, request_rate=0.8),
)}


def figure(summary: dict, metric: str, stat: str | None) -> float | None:
    if stat is None:
        return float(summary[metric])
    v = summary[f"{metric}_ms"].get(stat)
    return None if v is None else float(v)


def compare(predicted: list[dict], measured: list[dict]) -> list[dict]:
    """Per figure: the mean prediction and the mean measurement over repeats, the relative
    error of the means, and how far the repeated measurements spread (max/min - 1): the
    noise floor a prediction cannot be checked below."""
    rows = []
    for metric, stat in FIGURES:
        ps = [v for s in predicted if (v := figure(s, metric, stat)) is not None]
        ms = [v for s in measured if (v := figure(s, metric, stat)) is not None]
        p = sum(ps) / len(ps) if ps else None
        m = sum(ms) / len(ms) if ms else None
        err = (p / m - 1.0) if p is not None and m else None
        spread = (max(ms) / min(ms) - 1.0) if len(ms) > 1 and min(ms) > 0 else None
        rows.append({"figure": f"{metric} {stat or ''}".strip(), "predicted": p, "measured": m, "rel_err": err,
                     "measured_each": ms, "predicted_each": ps, "repeat_spread": spread})
    return rows


def case_config(case: Case, model: str, dtype: str, transport: str):
    from cluster.config import ClusterConfig

    return ClusterConfig.embedded(model=model, prefill=case.prefill, decode=case.decode, mode=case.mode,
                                  transport=transport, port=0, engine={"dtype": dtype})


def case_workload(case: Case, max_model_len: int) -> Workload:
    return build_workload(case.dataset, num_requests=case.num_requests, length_scale=case.length_scale,
                          max_model_len=max_model_len, request_rate=case.request_rate, seed=case.seed)


def predict(case: Case, lm: LatencyModel, model: str, dtype: str, transport: str, max_model_len: int,
            dispersion: dict | None = None) -> dict:
    """The simulator's figures for the case; with `dispersion` (residuals of load runs,
    `dispersion.pool`), TTFT and TPOT as their expectation over one run's per-request spread
    (`dispersion.disperse_summary`; the simulator's own under summary["deterministic"])."""
    from planning.dispersion import disperse_summary
    from planning.sim_config import sim_cluster
    from planning.simulator import simulate

    cluster = sim_cluster(case_config(case, model, dtype, transport), profile=lm, max_model_len=max_model_len)
    res = simulate(cluster, case_workload(case, max_model_len))
    summary = summarize(res.records, res.duration_s)
    if dispersion:
        summary = disperse_summary(summary, res.records, dispersion)
    return {"summary": summary, "workers": res.workers, "sim_wall_s": res.wall_s,
            "requests": [compact_record(r) for r in res.records]}


def measure_case(case: Case, lm: LatencyModel, *, model: str, dtype: str, transport: str, max_model_len: int,
                 salt: int, calibrate: bool = True, bracket: bool = False, load: bool = True,
                 load_requests: int | None = None) -> dict:
    """Start the case's cluster; calibrate the model on it (served decode steps, first-token
    delay, prefill drift: serving_profile.CALIBRATE, synthetic requests only); replay the case's
    workload on it and measure (`predict_run` adds the prediction). With `bracket`, calibrate
    again after the replay and fit on both sets of points, so that the machine drifting while
    the case runs (by 20-30 % within one repeat on a 2-core VM;
    docs/notebook/2026-12-05-capacity-planning-validation-runs.md) falls on the prediction as on
    the measurement; the prediction then uses synthetic requests timed on both sides of the
    replay, still never the workload itself.

    With `load` (and `calibrate`), a load run follows the first calibration: synthetic requests
    with the case's length distribution (not its requests) arriving at the case's rate
    (`load_run.load_workload`). Simulated with the calibrated model and compared request by
    request with what it measured, it gives what a staggered load costs beyond the calibration
    (`load_run.fit_load`; its samples are returned for `validate` to pool over repeats)."""
    from loadgen.client import model_info, run_benchmark
    from planning import serving_profile
    from cluster.runtime import Cluster

    wl = case_workload(case, max_model_len)
    cluster = Cluster(case_config(case, model, dtype, transport))
    address = cluster.start()
    try:
        info = asyncio.run(model_info(address))

        def measure(seed: int) -> dict:
            return serving_profile.measure_serving(address, info.vocab_size, info.max_model_len,
                                                   serving_profile.CALIBRATE, seed=seed)

        points = measure(1000 + salt) if calibrate else None
        # the load run's lengths follow the case's length distribution (log-normal, two moments each)
        load_result = run_load(address, info.vocab_size, info.max_model_len, case.request_rate,
                               seed=3000 + salt, num_requests=load_requests, like=wl) \
            if calibrate and load else None
        materialize_prompts(wl, info.vocab_size, seed=case.seed + 7919 * salt)
        records, duration, _ = asyncio.run(run_benchmark(address, wl, progress=False, run_tag=case.name))
        if calibrate and bracket:
            points = serving_profile.merge_points(points, measure(2000 + salt))
    finally:
        cluster.stop()
    cal, samples = {}, None
    if calibrate:
        lm, cal = serving_profile.calibrate(lm, points)
        cal["points"] = points
        if load_result is not None:
            samples = load_samples(lm, case_config(case, model, dtype, transport), *load_result,
                                   max_model_len=max_model_len)
            cal["load"] = fit_samples([samples])  # this repeat's own fit
            cal["load_requests"] = [compact_record(r) for r in load_result[1]]  # to re-fit offline
    meas = {"summary": summarize(records, duration), "failed": sum(not r.ok for r in records),
            "requests": [compact_record(r) for r in records]}
    return {"measured": meas, "calibration": cal, "model": lm, "load_samples": samples, "load_result": load_result}


def fitted_model(case: Case, run: dict, load_fit: dict | None) -> LatencyModel:
    """A measured repeat's (`measure_case`) calibrated model carrying `load_fit` (the case's
    repeats pooled, `validate`) or, without, its own load run's fit."""
    lm = run["model"]
    if run["load_samples"] is not None:
        fit = load_fit or run["calibration"]["load"]
        run["calibration"]["load_used"] = fit
        lm = with_load(lm, fit, case.request_rate)
    return lm


def predict_run(case: Case, run: dict, load_fit: dict | None, *, model: str, dtype: str, transport: str,
                max_model_len: int, dispersion: dict | None = None) -> dict:
    """A measured repeat completed with its prediction (`fitted_model`, `predict` with
    `dispersion`). The in-memory model, samples and load run give way to the model's JSON."""
    lm = fitted_model(case, run, load_fit)
    for k in ("model", "load_samples", "load_result"):
        run.pop(k, None)
    run["predicted"] = predict(case, lm, model, dtype, transport, max_model_len, dispersion)
    run["latency_model"] = lm.to_json()
    return run


def validate(cases: list[Case], lm: LatencyModel, *, model: str, dtype: str, transport: str = "nixl",
             max_model_len: int, calibrate: bool = True, repeats: int = 1, bracket: bool = False,
             load: bool = True, load_requests: int | None = None, pool_load: bool = True, disperse: bool = True,
             log=print) -> list[dict]:
    """Each case `repeats` times (fresh cluster, calibration and prediction each time). With
    `pool_load`, one load fit from the load runs of all the case's repeats (`fit_samples`)
    predicts every repeat: a load run of ~60 s holds 20-40 requests, and its first-token offset
    alone, a median of the quiet ones, moves by ~5 ms between repeats of a case
    (docs/notebook/2026-12-05-capacity-planning-validation-runs.md). Each repeat's own fit stays
    in its calibration ("load").
    With `disperse`, the predicted TTFT and TPOT figures are expectations over the per-request
    spread the load runs showed beyond the fitted model (`dispersion`; pooled over repeats)."""
    from planning import dispersion

    out = []
    for i, case in enumerate(cases):
        t0 = time.time()
        runs = [measure_case(case, lm, model=model, dtype=dtype, transport=transport, max_model_len=max_model_len,
                             salt=1 + i + 100 * k, calibrate=calibrate, bracket=bracket, load=load,
                             load_requests=load_requests) for k in range(repeats)]
        samples = [r["load_samples"] for r in runs if r["load_samples"] is not None]
        pooled = fit_samples(samples) if pool_load and samples else None
        spread = None
        if disperse and samples:
            cfg = case_config(case, model, dtype, transport)
            each = [load_residuals(fitted_model(case, r, pooled), cfg, *r["load_result"], max_model_len=max_model_len)
                    for r in runs if r["load_result"] is not None]
            spread = dispersion.pool(each)
        runs = [predict_run(case, r, pooled, model=model, dtype=dtype, transport=transport,
                            max_model_len=max_model_len, dispersion=spread) for r in runs]
        rows = compare([r["predicted"]["summary"] for r in runs], [r["measured"]["summary"] for r in runs])
        out.append({"case": asdict(case), "description": case.describe(), "rows": rows, "runs": runs,
                    "failed": sum(r["measured"]["failed"] for r in runs), "wall_s": time.time() - t0,
                    "dispersion": dict(dispersion.describe(spread), residuals=spread) if spread else None})
        log(format_case(out[-1]))
    return out


def format_case(result: dict) -> str:
    n = len(result["runs"])
    lines = [f"== {result['case']['name']}: {result['description']}, {n} run(s) (failed: {result['failed']})",
             f"   {'figure':<22}{'predicted':>12}{'measured':>12}{'error':>9}{'repeat spread':>15}"]
    for r in result["rows"]:
        p = "-" if r["predicted"] is None else f"{r['predicted']:.2f}"
        m = "-" if r["measured"] is None else f"{r['measured']:.2f}"
        e = "-" if r["rel_err"] is None else f"{r['rel_err']:+.1%}"
        sp = "-" if r["repeat_spread"] is None else f"{r['repeat_spread']:.1%}"
        lines.append(f"   {r['figure']:<22}{p:>12}{m:>12}{e:>9}{sp:>15}")
    return "\n".join(lines)
