"""`pdcluster bench disagg-vs-colocated`: the experiment behind docs/experiments.md.

Same hardware, model and code in both arms; only the roles differ:
- disaggregated: 1 prefill + 1 decode worker (one thread each, KV over NIXL);
- colocated: 2 workers that each prefill and decode (one thread each), same router.

Each arm serves the Azure LLM conversation trace (2023; Azure/AzurePublicDataset, CC-BY-4.0,
as processed by microsoft/vidur) with lengths scaled to the `bench` model and the trace's own
arrival pattern time-scaled to a few request rates, measured by `bench serve`'s client
(`loadgen`). It reports TTFT p50/p99, ITL p50/p99, TPOT p90 and goodput at several SLOs
(one that binds on decode smoothness, one that binds on TTFT) for each arm and rate, the
disaggregated/colocated ratios, plots, and JSON.

Benchmarks are not tests: the machine is shared and noisy, so both arms run in the same
invocation, one after the other, on the same requests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

ITL_P99_TARGET = 0.3      # disaggregated ITL p99 <= 0.3x colocated at the highest rate
GOODPUT_TARGET = 1.5      # disaggregated goodput >= 1.5x colocated under TARGET_SLO


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bench", help="built-in preset or checkpoint folder (default bench)")
    p.add_argument("--dtype", default="bfloat16", help="engine dtype on both arms (default bfloat16)")
    p.add_argument("--dataset", default="azure-conv")
    p.add_argument("--rates", default="0.4,0.7,1.0", help="request rates (req/s) to replay the trace at")
    p.add_argument("--num-requests", type=int, default=96, help="requests per (arm, rate)")
    p.add_argument("--length-scale", type=float, default=0.75, help="prompt and output lengths x this")
    p.add_argument("--slo", action="append", default=None,
                   help="an SLO set 'name=ttft:MS,itl:MS' (repeatable); default: DEFAULT_SLOS (stall-free, "
                        "decode-bound, TTFT-bound); the goodput target is judged under the first")
    p.add_argument("--transport", default="nixl", choices=("nixl", "grpc"))
    p.add_argument("--attention-backend", default="auto", choices=("auto", "cpu", "torch", "flashinfer"),
                   help="engine attention backend on both arms (default auto)")
    p.add_argument("--arms", default="disaggregated,colocated",
                   help="which arms to run (comma list of disaggregated, colocated); with one arm there are "
                        "no ratios: for A/B runs of one arm across commits")
    p.add_argument("--json", default="disagg-vs-colocated.json")
    p.add_argument("--plot", default=None, help="write PNGs here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate", metavar="PROFILE", default=None,
                   help="predict instead of measuring: run both arms in `plan simulate`'s simulator with this "
                        "profile (`plan profile --serving`), on exactly the same requests; no cluster is started")


DEFAULT_SLOS = {"stall-free stream (TTFT<=8s, every gap<=250ms)": {"ttft": 8000.0, "itl": 250.0},
                "decode-bound (TTFT<=8s, TPOT<=150ms)": {"ttft": 8000.0, "tpot": 150.0},
                "TTFT-bound (TTFT<=2s, TPOT<=1s)": {"ttft": 2000.0, "tpot": 1000.0}}
# A user watching a stream notices a stall, so the goodput target is judged under the
# stall-free SLO (chosen before measuring); the other two show where colocation wins.
# Default rates and requests per point (0.4/0.7/1.0 req/s, 96 requests): the top rate has to
# load the machine enough that more than 1% of colocated chunk gaps are prefill stalls; at
# 0.7 req/s and 48 requests under 1% were, so ITL p99 fell just below them. Chosen from shorter
# runs and a simulation (docs/notebook/2026-12-03-disagg-vs-colocated-runs.md); how to choose
# rates for another machine: docs/experiments.md.


ARMS = ("disaggregated", "colocated")


def _arms(args: argparse.Namespace) -> list[str]:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if not arms or bad or len(set(arms)) != len(arms):
        raise SystemExit(f"--arms must list distinct arms of {', '.join(ARMS)}, got {args.arms!r}")
    return arms


def _parse_slos(items: list[str] | None) -> dict[str, dict[str, float]]:
    if not items:
        return dict(DEFAULT_SLOS)
    from loadgen.metrics import parse_slo

    out = {}
    for item in items:
        name, _, spec = item.partition("=")
        if not spec:
            raise SystemExit(f"--slo must look like 'name=ttft:MS,tpot:MS', got {item!r}")
        out[name] = parse_slo(spec.split(","))
    return out


def _arm_config(arm: str, model: str, dtype: str, transport: str, attention_backend: str = "auto"):
    from cluster.config import ClusterConfig

    engine = {"dtype": dtype, "attention_backend": attention_backend}
    if arm == "disaggregated":
        return ClusterConfig.embedded(model=model, prefill=1, decode=1, transport=transport, port=0, engine=engine)
    return ClusterConfig.embedded(model=model, decode=2, mode="colocated", transport=transport, port=0,
                                  engine=engine)


def _model_info(address: str):
    import grpc

    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        return pb_grpc.InferenceStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=10)


def _pick(summary: dict, metric: str, stat: str) -> float | None:
    m = summary.get(f"{metric}_ms") or {}
    v = m.get(stat)
    return None if v is None else float(v)


def _workload(args: argparse.Namespace, rate: float, index: int, max_model_len: int, vocab_size: int | None):
    """The rate's requests: the trace's first requests, its own arrival pattern (its bursts)
    stretched to `rate`, and fresh prompt tokens per rate (a cluster serves every rate, and
    repeating the previous rate's prompts would turn the next one into prefix-cache hits). The
    simulator needs no tokens (vocab_size None): it sees a prompt's length and prefix blocks."""
    from loadgen.workloads import build_workload, materialize_prompts

    wl = build_workload(args.dataset, num_requests=args.num_requests, length_scale=args.length_scale,
                        max_model_len=max_model_len, seed=args.seed)
    span = wl.requests[-1].arrival_s - wl.requests[0].arrival_s
    stretch = (len(wl.requests) - 1) / rate / span if span > 0 else 1.0
    for r in wl.requests:
        r.arrival_s *= stretch
    if vocab_size is not None:
        materialize_prompts(wl, vocab_size, seed=args.seed + 1000 * index)
    return wl


def _entry(arm: str, rate: float, records, duration: float, timeline, slos: dict) -> dict:
    from loadgen.metrics import summarize

    return {"arm": arm, "rate": rate, "duration_s": duration,
            "summary": summarize(records, duration, percentiles=(50, 90, 99)),
            "goodput": {name: summarize(records, duration, percentiles=(50, 90, 99), slo=slo)["goodput"]
                        for name, slo in slos.items()},
            "records": [r.__dict__ if hasattr(r, "__dict__") else _asdict(r) for r in records],
            "timeline": timeline}


def _simulate_arms(args: argparse.Namespace, rates: list[float], slos: dict) -> list[dict]:
    """Both arms in the simulator, configured as `_arm_config` starts them, on the same requests."""
    from planning.latency import LatencyModel
    from planning.sim_config import DEFAULT_MAX_MODEL_LEN, sim_cluster
    from planning.simulator import simulate

    profile = LatencyModel.load(args.simulate)
    max_len = int(profile.meta.get("max_model_len") or DEFAULT_MAX_MODEL_LEN)
    results = []
    for arm in _arms(args):
        config = _arm_config(arm, args.model, args.dtype, args.transport, args.attention_backend)
        cluster = sim_cluster(config, profile=profile,
                              max_model_len=max_len)
        for i, rate in enumerate(rates):
            res = simulate(cluster, _workload(args, rate, i, max_len, None))
            results.append(_entry(arm, rate, res.records, res.duration_s, res.timeline, slos))
            _print_point(results[-1])
    return results


def _print_point(entry: dict) -> None:
    s, arm, rate = entry["summary"], entry["arm"], entry["rate"]
    print(f"[{arm}] rate {rate}: ttft p50 {_ms(_pick(s, 'ttft', 'median'))} p99 "
          f"{_ms(_pick(s, 'ttft', 'p99'))}  itl p50 {_ms(_pick(s, 'itl', 'median'))} p99 "
          f"{_ms(_pick(s, 'itl', 'p99'))}  failed {s.get('failed')}", flush=True)
    for code, details in s["error_details"].items():  # a failure's cause, not just its code
        for detail, n in details.items():
            print(f"[{arm}] rate {rate}: {n} x {code}: {detail}", flush=True)


def _measure_arms(args: argparse.Namespace, rates: list[float], slos: dict) -> list[dict]:
    """Both arms on real local clusters, one after the other, on the same requests."""
    from loadgen.client import run_benchmark
    from cluster.runtime import Cluster

    results = []
    for arm in _arms(args):
        cluster = Cluster(_arm_config(arm, args.model, args.dtype, args.transport, args.attention_backend))
        address = cluster.start()
        try:
            info = _model_info(address)
            print(f"[{arm}] serving on {address}", flush=True)
            for i, rate in enumerate(rates):
                wl = _workload(args, rate, i, info.max_model_len, info.vocab_size)
                records, duration, timeline = asyncio.run(run_benchmark(address, wl, progress=False))
                results.append(_entry(arm, rate, records, duration, timeline, slos))
                _print_point(results[-1])
                if args.plot:
                    from loadgen.report import write_plots

                    write_plots(Path(args.plot) / f"{arm}-rate{rate}", records, timeline)
        finally:
            cluster.stop()
    return results


def run(args: argparse.Namespace) -> int:
    both = len(_arms(args)) == 2  # with one arm (an A/B across commits) there is nothing to compare
    rates = [float(r) for r in args.rates.split(",")]
    if not rates or min(rates) <= 0:
        raise SystemExit(f"--rates must be positive request rates, got {args.rates!r}")
    slos = _parse_slos(args.slo)
    t_start = time.time()
    results = _simulate_arms(args, rates, slos) if args.simulate else _measure_arms(args, rates, slos)
    table = _table(results, rates, slos)
    print(table)
    ratios = _ratios(results, rates, slos) if both else {}
    out = {"config": vars(args) | {"slos": slos, "simulated": bool(args.simulate)}, "host": platform.node(),
           "wall_s": time.time() - t_start,
           "ratios": ratios, "runs": results}
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    if both:
        print(json.dumps(ratios, indent=1))
    if args.plot and both:
        _plot_summary(results, rates, slos, Path(args.plot), f"{args.model}, {args.dtype}")
        _plot_itl_tail(results, max(rates), Path(args.plot))
    return 0


def _asdict(r) -> dict:
    from dataclasses import asdict

    return asdict(r)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}ms"


def _get(results, arm, rate):
    return next(r for r in results if r["arm"] == arm and r["rate"] == rate)


def _goodput_rate(entry: dict, name: str) -> float:
    return float(entry["goodput"].get(name) or 0.0)


def _ratios(results, rates, slos) -> dict:
    top = max(rates)
    d, c = _get(results, "disaggregated", top), _get(results, "colocated", top)
    out = {"rate": top}
    for key in ("itl_p99", "ttft_p99", "tpot_p90", "itl_p50", "ttft_p50"):
        metric, stat = key.rsplit("_", 1)
        stat = "median" if stat == "p50" else stat
        dv, cv = _pick(d["summary"], metric, stat), _pick(c["summary"], metric, stat)
        out[f"{key}_disagg_over_colocated"] = (dv / cv) if dv is not None and cv else None
    for name in slos:
        dg, cg = _goodput_rate(d, name), _goodput_rate(c, name)
        out[f"goodput[{name}]_disagg_over_colocated"] = (dg / cg) if cg else (float("inf") if dg else None)
    out["itl_p99_target"] = ITL_P99_TARGET
    out["goodput_target"] = GOODPUT_TARGET
    out["goodput_target_slo"] = next(iter(slos))
    return out


def _table(results, rates, slos) -> str:
    names = list(slos)
    head = ["arm", "rate", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p90", "failed"] + \
        [f"goodput {i + 1}" for i in range(len(names))]
    rows = [head]
    for r in results:
        s = r["summary"]
        rows.append([r["arm"], f"{r['rate']:g}", _ms(_pick(s, "ttft", "median")), _ms(_pick(s, "ttft", "p99")),
                     _ms(_pick(s, "itl", "median")), _ms(_pick(s, "itl", "p99")), _ms(_pick(s, "tpot", "p90")),
                     str(s.get("failed"))] + [f"{_goodput_rate(r, n):.2f}/s" for n in names])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    legend = [f"goodput {i + 1}: {n}" for i, n in enumerate(names)]
    return "\n".join(lines + legend)


def _plot_summary(results, rates, slos, out: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    panels = [("ttft", "p99", "TTFT p99 (ms)"), ("itl", "p99", "ITL p99 (ms)"), ("tpot", "p90", "TPOT p90 (ms)")]
    fig, axes = plt.subplots(1, len(panels) + len(slos), figsize=(4.2 * (len(panels) + len(slos)), 3.6))
    for ax, (metric, stat, label) in zip(axes, panels):
        for arm in ARMS:
            ys = [_pick(_get(results, arm, r)["summary"], metric, stat) for r in rates]
            ax.plot(rates, ys, marker="o", label=arm)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax, name in zip(axes[len(panels):], slos):
        for arm in ARMS:
            ax.plot(rates, [_goodput_rate(_get(results, arm, r), name) for r in rates], marker="o", label=arm)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("goodput (req/s)")
        ax.set_title(name, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"1 prefill + 1 decode vs 2 colocated workers ({label}, CPU, Azure conv trace)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "disagg_vs_colocated.png", dpi=110)
    plt.close(fig)


def _plot_itl_tail(results, rate: float, out: Path) -> None:
    """Fraction of chunk gaps longer than x, both arms at one rate, log scales: a prefill stall
    is a rare gap (about 1% of them), so whether ITL p99 sees the stalls depends on whether the
    colocated curve crosses the p99 line before or after the stalls begin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in ARMS:
        recs = [r for r in _get(results, arm, rate)["records"] if r["ok"]]
        gaps = sorted(b - a for r in recs for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:]))
        n = len(gaps)
        if n:
            ax.step([g * 1e3 for g in gaps], [(n - i) / n for i in range(n)], where="post", label=arm)
    ax.axhline(0.01, color="grey", lw=0.8, ls="--")
    ax.text(ax.get_xlim()[0], 0.011, " p99", color="grey", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("gap between chunks (ms)")
    ax.set_ylabel("fraction of gaps longer")
    ax.set_title(f"ITL tail at {rate:g} req/s", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "itl_tail.png", dpi=110)
    plt.close(fig)
