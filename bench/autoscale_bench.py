"""`pdcluster bench autoscale`: elastic pools against static ones, on the same bursty load.

Three local clusters (loopback Ray, a built-in model in float32, one colocated pool) are started
one after the other and each gets the same requests:
- `small`: 1 replica, static;
- `large`: 2 replicas, static;
- `elastic`: min 1, max 2, the SLA planner (cluster.autoscale) in mode `on` with the SLO given
  here (`--slo-ttft-ms`, `--slo-itl-ms`, at p90), short windows and cooldowns so that it acts
  within a short run.

The load (`loadgen.client.run_benchmark`, the client of `bench serve`): by default a step,
idle -> burst -> idle (Poisson arrivals at `--idle-rate`, `--burst-rate`, `--idle-rate` for
`--phases` seconds); with `--dataset azure-conv` (or any `bench serve` trace name or path) the
trace's first `--num-requests` requests, time-compressed to the same total duration (its own
bursts kept), lengths fitted to the model's max_model_len.

Per config:
- SLO attainment: the fraction of all requests (failed ones count as misses) whose TTFT <= the
  TTFT SLO and whose own p90 chunk gap <= the ITL SLO (the planner's reading); `strict`: every
  chunk gap <= the ITL SLO (loadgen.metrics.meets_slo's reading);
- worker-seconds, the cost: ClusterStatus is polled every `--poll-s` during the run, and the
  pool's serving workers (state `serving`) are integrated over the load's span (held constant
  between polls); `provisioned` also counts workers starting, warming and draining (they hold
  their CPUs too);
- failed requests (should be 0);
- for `elastic`, the step response: from the burst's first arrival to the pool's target 2 (the
  planner's decision) and to its second worker serving, and the scale-in after the burst.
Ratios are elastic / small and elastic / large from the same run. `--json` writes everything;
`--plot` writes a timeline PNG (replicas per pool, arrival rate, TTFT and ITL p90 per time bin)
when matplotlib is importable, and always a CSV of the same bins.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
import threading
import time
from pathlib import Path

CONFIGS = ("small", "large", "elastic")
SERVING = ("serving",)
PROVISIONED = ("starting", "warming", "serving", "spare", "draining", "replacing", "unresponsive")
POOL = "colocated"


# ---- pure parts (tests/unit/test_autoscale_bench.py) ----------------------------------------------
def integrate_steps(samples: list[tuple[float, float]], t_start: float, t_end: float) -> float:
    """Integral over [t_start, t_end] of a step function given by (time, value) samples sorted by
    time: each value holds until the next sample; before the first sample, the first value."""
    if not samples or t_end <= t_start:
        return 0.0
    total = 0.0
    for i, (t, v) in enumerate(samples):
        lo = t_start if i == 0 else max(t, t_start)
        hi = samples[i + 1][0] if i + 1 < len(samples) else t_end
        hi = min(hi, t_end)
        if hi > lo:
            total += v * (hi - lo)
    return total


def quantile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def request_meets(ok: bool, ttft_s: float | None, chunk_times_s: list[float], ttft_slo_s: float,
                  itl_slo_s: float, q: float = 90.0, strict: bool = False) -> bool:
    """A request meets the SLO: it completed, TTFT <= ttft_slo_s and its chunk gaps' q-th
    percentile (strict: every gap) <= itl_slo_s; one chunk has no gap to miss."""
    if not ok or ttft_s is None or ttft_s > ttft_slo_s:
        return False
    gaps = [b - a for a, b in zip(chunk_times_s, chunk_times_s[1:])]
    if not gaps:
        return True
    return (max(gaps) if strict else quantile(gaps, q)) <= itl_slo_s


def slo_attainment(records, ttft_slo_s: float, itl_slo_s: float, q: float = 90.0, strict: bool = False) -> float:
    """Fraction of all records (failed ones are misses) meeting the SLO (`request_meets`)."""
    if not records:
        return 0.0
    good = sum(request_meets(r.ok, r.ttft_s, r.chunk_times_s, ttft_slo_s, itl_slo_s, q, strict) for r in records)
    return good / len(records)


def first_time_at(samples: list[tuple[float, float]], since: float, at_least: float) -> float | None:
    """The first sample time >= since whose value >= at_least, or None."""
    return next((t for t, v in samples if t >= since and v >= at_least), None)


def first_time_below(samples: list[tuple[float, float]], since: float, below: float) -> float | None:
    return next((t for t, v in samples if t >= since and v < below), None)


def step_arrivals(phases: list[tuple[float, float]], seed: int) -> list[float]:
    """Poisson arrival offsets for consecutive (duration_s, rate) phases; a rate of 0 is silence."""
    rng = random.Random(seed)
    out, start = [], 0.0
    for duration, rate in phases:
        t = start
        if rate > 0:
            while True:
                t += rng.expovariate(rate)
                if t >= start + duration:
                    break
                out.append(t)
        start += duration
    return out


def bin_timeline(records, bin_s: float, span_s: float) -> list[dict]:
    """Per time bin of the run (times from the load's start): arrivals per second (scheduled
    times), TTFT p90 of the requests sent in it, ITL p90 of the chunk gaps that ended in it."""
    n = max(1, math.ceil(span_s / bin_s))
    arrivals = [0] * n
    ttfts: list[list[float]] = [[] for _ in range(n)]
    itls: list[list[float]] = [[] for _ in range(n)]

    def idx(t: float) -> int:
        return min(n - 1, max(0, int(t // bin_s)))

    for r in records:
        arrivals[idx(r.scheduled_s)] += 1
        if r.ok and r.ttft_s is not None:
            ttfts[idx(r.start_s)].append(r.ttft_s)
        for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:]):
            itls[idx(r.start_s + b)].append(b - a)
    out = []
    for i in range(n):
        t90, i90 = quantile(ttfts[i], 90), quantile(itls[i], 90)
        out.append({"t_s": round(i * bin_s, 3), "arrival_rate": arrivals[i] / bin_s,
                    "ttft_p90_ms": None if t90 is None else round(t90 * 1e3, 2),
                    "itl_p90_ms": None if i90 is None else round(i90 * 1e3, 2)})
    return out


# ---- the command --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="a built-in model (tiny, small) or a checkpoint path")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--transport", default="grpc", help="KV transport of the config (a colocated pool sends none)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--quick", action="store_true", help="a shorter load (~90 s in all on 2 cores)")
    p.add_argument("--phases", default=None, metavar="IDLE,BURST,IDLE",
                   help="seconds of the step load's phases (default 10,25,20; --quick 2,8,5)")
    p.add_argument("--idle-rate", type=float, default=0.5, help="req/s outside the burst")
    p.add_argument("--burst-rate", type=float, default=12.0, help="req/s during the burst")
    p.add_argument("--input-len", default="32:96", help="MIN:MAX prompt tokens of the step load")
    p.add_argument("--output-len", default="48:96", help="MIN:MAX output tokens of the step load")
    p.add_argument("--dataset", default="step", help="step (default), or a `bench serve` trace name or path "
                                                     "(e.g. azure-conv), time-compressed to the phases' total")
    p.add_argument("--num-requests", type=int, default=None, help="trace requests (default 3 x the phases' "
                                                                   "total seconds)")
    p.add_argument("--warmup", type=int, default=8, help="requests sent at once before the load (not measured), "
                                                          "so every config starts with its batch shapes seen")
    p.add_argument("--slo-ttft-ms", type=float, default=250.0, help="TTFT SLO at p90 (planner and attainment)")
    p.add_argument("--slo-itl-ms", type=float, default=30.0, help="ITL SLO at p90 (planner and attainment)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--poll-s", type=float, default=0.25, help="ClusterStatus poll period")
    p.add_argument("--bin-s", type=float, default=None, help="timeline bin (default 2.5 s; --quick 1.5 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every figure, the timelines and per-request records here")
    p.add_argument("--plot", help="write autoscale_timeline.png (matplotlib) and .csv into this directory")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise ValueError(f"need 1 <= MIN <= MAX, got {text!r}")
    return a, b


def _phases(args) -> list[float]:
    text = args.phases or ("2,8,5" if args.quick else "10,25,20")
    ph = [float(x) for x in text.split(",")]
    if len(ph) != 3 or not all(x > 0 for x in ph):
        raise ValueError(f"--phases must be three seconds > 0, got {text!r}")
    return ph


def _engine(args) -> dict:
    return dict(dtype=args.dtype, num_pages=max(512, 4 * args.max_model_len // 16), max_model_len=args.max_model_len,
                max_num_batched_tokens=512, max_num_seqs=32, page_size=16)


def cluster_config(name: str, args):
    from cluster.config import ClusterConfig

    replicas = 2 if name == "large" else 1
    cfg = ClusterConfig.embedded(model=args.model, decode=replicas, mode="colocated", transport=args.transport,
                                 port=0, policy="round-robin", engine=_engine(args))
    if name != "elastic":
        return cfg
    auto = {"mode": "on", "pools": {POOL: {"min_replicas": 1, "max_replicas": 2}},
            "slo": {"ttft_s": args.slo_ttft_ms / 1e3, "itl_s": args.slo_itl_ms / 1e3, "percentile": 90},
            "interval_s": 0.5, "window_s": 3.0, "up_cooldown_s": 0.0, "down_cooldown_s": 6.0,
            "slow_interval_s": 600.0}
    return ClusterConfig.model_validate({**cfg.model_dump(), "autoscale": auto})


def build_load(args, max_model_len: int, vocab_size: int):
    from loadgen.workloads import Workload, WorkloadRequest, build_workload, materialize_prompts

    idle1, burst, idle2 = _phases(args)
    total = idle1 + burst + idle2
    if args.dataset == "step":
        times = step_arrivals([(idle1, args.idle_rate), (burst, args.burst_rate), (idle2, args.idle_rate)], args.seed)
        rng = random.Random(args.seed + 1)
        ilo, ihi = _range(args.input_len)
        olo, ohi = _range(args.output_len)
        wl = Workload([WorkloadRequest(i, t, rng.randint(ilo, ihi), rng.randint(olo, ohi))
                       for i, t in enumerate(times)], 0, "step",
                      {"phases_s": [idle1, burst, idle2], "idle_rate": args.idle_rate, "burst_rate": args.burst_rate})
        step_s = idle1
    else:
        n = args.num_requests or int(3 * total)
        wl = build_workload(args.dataset, num_requests=n, max_model_len=max_model_len, seed=args.seed)
        span = wl.requests[-1].arrival_s - wl.requests[0].arrival_s
        squeeze = total / span if span > 0 else 1.0
        for r in wl.requests:
            r.arrival_s *= squeeze
        wl.meta["time_compression"] = squeeze
        step_s = 0.0
    materialize_prompts(wl, vocab_size, args.seed)
    return wl, step_s, total


class StatusPoller:
    """ClusterStatus every period in a thread: (time since t0, pool target, pool current, serving
    workers, provisioned workers) per poll."""

    def __init__(self, address: str, period_s: float) -> None:
        import grpc

        from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

        self.period_s, self.t0 = period_s, time.perf_counter()
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="autoscale-bench-poll")

    def start(self) -> StatusPoller:
        self._t.start()
        return self

    def _run(self) -> None:
        import grpc

        from proto.pdcluster.v1 import inference_pb2 as pb

        while not self._stop.is_set():
            try:
                st = self.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
            except grpc.RpcError:
                self._stop.wait(self.period_s)
                continue
            now = time.perf_counter()
            pool = next((p for p in st.pools if p.name == POOL), None)
            ws = [w for w in st.workers if w.pool == POOL]
            self.samples.append({"t_abs": now, "target": pool.target_replicas if pool else 0,
                                 "current": pool.current_replicas if pool else 0,
                                 "serving": sum(w.state in SERVING for w in ws),
                                 "provisioned": sum(w.state in PROVISIONED for w in ws),
                                 "failed_total": st.requests_failed})
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)
        self.channel.close()


def _wait_pool(address: str, replicas: int, timeout_s: float) -> None:
    """Until the pool's target and serving workers are both `replicas` (or the timeout)."""
    import grpc

    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        while time.monotonic() < deadline:
            st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
            pool = next((p for p in st.pools if p.name == POOL), None)
            if pool is not None and pool.target_replicas == pool.current_replicas == replicas:
                return
            time.sleep(0.25)
    print(f"pool {POOL} not at {replicas} replica(s) after {timeout_s:.0f} s: measuring anyway", flush=True)


def _series(samples: list[dict], key: str) -> list[tuple[float, float]]:
    return [(s["t"], float(s[key])) for s in samples]


def run_config(name: str, args) -> dict:
    import asyncio

    import grpc

    from cluster.runtime import Cluster
    from engine.heap import heap_frozen
    from loadgen.client import run_benchmark
    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    events: list[str] = []
    t_boot = time.perf_counter()
    cluster = Cluster(cluster_config(name, args), on_event=events.append)
    try:
        address = cluster.start()
        boot_s = time.perf_counter() - t_boot
        with grpc.insecure_channel(address) as ch:
            info = pb_grpc.InferenceStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=10)
        wl, step_s, total = build_load(args, info.max_model_len, info.vocab_size)
        print(f"[{name}] serving on {address} after {boot_s:.1f} s; {len(wl.requests)} requests over {total:.0f} s",
              flush=True)
        if args.warmup:
            from loadgen.workloads import materialize_prompts, random_workload

            warm = random_workload(args.warmup, _range(args.input_len), _range(args.output_len), args.seed + 7)
            materialize_prompts(warm, info.vocab_size, args.seed + 7)
            recs, _, _ = asyncio.run(run_benchmark(address, warm, progress=False, timeout_s=300.0,
                                                   run_tag=f"warmup-{name}"))
            if not all(r.ok for r in recs):
                print(f"[{name}] warm-up: {sum(not r.ok for r in recs)} request(s) failed", flush=True)
            # the elastic one: past the planner's window, so the warm-up is not what it sees at the load's start
            time.sleep(4.0 if name == "elastic" else 0.5)
        if name == "elastic":
            _wait_pool(address, 1, 60.0)
        poller = StatusPoller(address, args.poll_s).start()
        try:
            with heap_frozen():  # the client's own freeze below then collects almost nothing
                t0 = time.perf_counter()
                records, duration, _ = asyncio.run(run_benchmark(address, wl, progress=False, timeout_s=300.0,
                                                                 run_tag=f"autoscale-{name}"))
            time.sleep(max(0.0, args.poll_s * 2))
        finally:
            poller.stop()
    finally:
        cluster.stop()
    samples = [dict(s, t=round(s.pop("t_abs") - t0, 3)) for s in poller.samples]
    return analyse(name, args, records, duration, samples, step_s, total, boot_s, events)


def analyse(name: str, args, records, duration: float, samples: list[dict], step_s: float, total: float,
            boot_s: float, events: list[str]) -> dict:
    slo_t, slo_i = args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3
    span = max(total, duration)
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itls_s]
    out = {"config": name, "requests": len(records), "failed": len(records) - len(ok),
           "errors": sorted({f"{r.error}: {r.error_detail}" for r in records if not r.ok}),
           "duration_s": round(duration, 2), "span_s": round(span, 2), "boot_s": round(boot_s, 1),
           "slo_attainment": slo_attainment(records, slo_t, slo_i),
           "slo_attainment_strict": slo_attainment(records, slo_t, slo_i, strict=True),
           "worker_seconds": integrate_steps(_series(samples, "serving"), 0.0, span),
           "worker_seconds_provisioned": integrate_steps(_series(samples, "provisioned"), 0.0, span),
           "ttft_p90_ms": _ms(quantile(ttft, 90)), "ttft_p50_ms": _ms(quantile(ttft, 50)),
           "itl_p90_ms": _ms(quantile(itl, 90)), "itl_p50_ms": _ms(quantile(itl, 50)),
           "max_serving": max((s["serving"] for s in samples), default=0),
           "bins": bin_timeline(records, args.bin_s or (1.5 if args.quick else 2.5), span),
           "status": samples, "events": [e for e in events if "pool " in e or "autoscale" in e][:200],
           "records": [_record(r) for r in records]}
    if name == "elastic":
        tgt, cur = _series(samples, "target"), _series(samples, "current")
        up_t, serve_t = first_time_at(tgt, step_s, 2), first_time_at(cur, step_s, 2)
        down_t = first_time_below(cur, serve_t, 2) if serve_t is not None else None
        last_arrival = max((r.scheduled_s for r in records), default=0.0)
        out["step"] = {"load_step_s": step_s, "target_2_after_s": _rel(up_t, step_s),
                       "second_serving_after_s": _rel(serve_t, step_s),
                       "back_to_1_at_s": None if down_t is None else round(down_t, 2),
                       "last_arrival_s": round(last_arrival, 2)}
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def _rel(t: float | None, since: float) -> float | None:
    return None if t is None else round(t - since, 2)


def _record(r) -> dict:
    return {"index": r.index, "scheduled_s": round(r.scheduled_s, 3), "start_s": round(r.start_s, 3), "ok": r.ok,
            "error": r.error, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
            "ttft_ms": _ms(r.ttft_s), "itl_p90_ms": _ms(quantile(r.itls_s, 90)),
            "worker": r.server.get("decode_worker", "")}


def ratios(results: dict[str, dict]) -> dict:
    el = results.get("elastic")
    out = {}
    if el is None:
        return out
    for base in ("small", "large"):
        b = results.get(base)
        if b is None:
            continue
        out[f"elastic_vs_{base}"] = {
            "worker_seconds": _div(el["worker_seconds"], b["worker_seconds"]),
            "slo_attainment": _div(el["slo_attainment"], b["slo_attainment"]),
            "ttft_p90": _div(el["ttft_p90_ms"], b["ttft_p90_ms"]),
            "itl_p90": _div(el["itl_p90_ms"], b["itl_p90_ms"])}
    return out


def _div(a, b):
    return None if a is None or not b else round(a / b, 3)


def write_timeline(directory: str, results: dict[str, dict]) -> list[Path]:
    """autoscale_timeline.csv always; autoscale_timeline.png when matplotlib imports."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / "autoscale_timeline.csv"]
    with open(paths[0], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "t_s", "arrival_rate", "ttft_p90_ms", "itl_p90_ms", "serving", "target"])
        for name, res in results.items():
            serving, target = _series(res["status"], "serving"), _series(res["status"], "target")
            for b in res["bins"]:
                w.writerow([name, b["t_s"], round(b["arrival_rate"], 3), b["ttft_p90_ms"], b["itl_p90_ms"],
                            _at(serving, b["t_s"]), _at(target, b["t_s"])])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: timeline written as CSV only", file=sys.stderr)
        return paths
    fig, ax = plt.subplots(4, 1, figsize=(8, 8.5), sharex=True)
    colors = {"small": "tab:blue", "large": "tab:orange", "elastic": "tab:green"}
    for name, res in results.items():
        st = res["status"]
        ax[0].step([s["t"] for s in st], [s["serving"] for s in st], where="post", color=colors.get(name),
                   label=f"{name} serving")
        if name == "elastic":
            ax[0].step([s["t"] for s in st], [s["target"] for s in st], where="post", color=colors[name],
                       linestyle=":", label="elastic target")
        bins = res["bins"]
        ts = [b["t_s"] + (bins[1]["t_s"] if len(bins) > 1 else 1) / 2 for b in bins]
        ax[2].plot(ts, [b["ttft_p90_ms"] for b in bins], marker=".", color=colors.get(name), label=name)
        ax[3].plot(ts, [b["itl_p90_ms"] for b in bins], marker=".", color=colors.get(name), label=name)
    first = next(iter(results.values()))
    bins = first["bins"]
    width = bins[1]["t_s"] if len(bins) > 1 else 1.0
    ax[1].bar([b["t_s"] for b in bins], [b["arrival_rate"] for b in bins], width=width, align="edge",
              color="grey")
    ax[0].set_ylabel(f"{POOL} workers")
    ax[1].set_ylabel("arrivals / s")
    ax[2].set_ylabel("TTFT p90 (ms)")
    ax[3].set_ylabel("ITL p90 (ms)")
    ax[2].set_yscale("log")
    ax[3].set_yscale("log")
    ax[3].set_xlabel("s since the load began")
    for a in (ax[0], ax[2], ax[3]):
        a.legend(fontsize=7, loc="upper right")
    fig.suptitle("pdcluster bench autoscale: static 1, static 2, elastic 1..2", fontsize=10)
    fig.tight_layout()
    paths.append(d / "autoscale_timeline.png")
    fig.savefig(paths[-1], dpi=72)
    plt.close(fig)
    return paths


def _at(series: list[tuple[float, float]], t: float):
    v = None
    for ts, val in series:
        if ts > t:
            break
        v = val
    return series[0][1] if v is None and series else v


def _print(res: dict) -> None:
    print(f"[{res['config']}] requests {res['requests']} failed {res['failed']}  SLO attainment "
          f"{res['slo_attainment']:.3f} (strict {res['slo_attainment_strict']:.3f})  worker-s "
          f"{res['worker_seconds']:.1f} (provisioned {res['worker_seconds_provisioned']:.1f})  TTFT p50/p90 "
          f"{res['ttft_p50_ms']}/{res['ttft_p90_ms']} ms  ITL p50/p90 {res['itl_p50_ms']}/{res['itl_p90_ms']} ms",
          flush=True)
    if "step" in res:
        print(f"[elastic] step response: {res['step']}", flush=True)
    for e in res["errors"]:
        print(f"[{res['config']}] failed: {e}", flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        names = [c for c in args.configs.split(",") if c]
        bad = [c for c in names if c not in CONFIGS]
        if bad or not names:
            raise ValueError(f"--configs must name some of {', '.join(CONFIGS)}, got {args.configs!r}")
        _phases(args)
        _range(args.input_len), _range(args.output_len)
        if not (args.slo_ttft_ms > 0 and args.slo_itl_ms > 0 and args.poll_s > 0):
            raise ValueError("--slo-ttft-ms, --slo-itl-ms and --poll-s must be > 0")
        if args.dataset != "step":
            from loadgen.workloads import KINDS

            if args.dataset not in KINDS and not Path(args.dataset).is_file():
                raise ValueError(f"--dataset must be step, one of {', '.join(KINDS)} or a trace path")
    except ValueError as exc:
        print(f"pdcluster bench autoscale: {exc}", file=sys.stderr)
        return 2
    t_all = time.perf_counter()
    results: dict[str, dict] = {}
    for name in names:
        results[name] = run_config(name, args)
        _print(results[name])
    rat = ratios(results)
    for k, v in rat.items():
        print(f"{k}: {v}", flush=True)
    wall = time.perf_counter() - t_all
    print(f"total wall time {wall:.0f} s", flush=True)
    settings = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    if args.plot:
        for p in write_timeline(args.plot, results):
            print(f"wrote {p}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"settings": settings, "wall_s": round(wall, 1), "ratios": rat,
                                               "results": results}, indent=1, default=str))
        print(f"wrote {args.json}")
    return 1 if any(r["failed"] for r in results.values()) else 0
