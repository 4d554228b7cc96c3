"""Each autoscaled pool's floor of replicas from planning's simulator: the slow loop of the SLA
planner (cluster/autoscale.py) runs this module in a process of its own,

    python -m planning.floor  < request JSON  > result JSON

because planning sits above cluster in the package layers and the router's process never
imports the simulator's engine types. `FloorRequest` is what comes in: the cluster config (pools
at their current targets, KV pages as the workers report them), the pools the planner resizes
with their min and max, the latency profile, the slow window's fit and the SLO.

From the window's fit (arrival rate, prompt and output length mean and coefficient of
variation, prefix-cache hit rate) `synthesize` draws a workload: Poisson arrivals, lognormal
lengths with that mean and spread, and a shared prefix of the hit rate's share of each prompt.
`find_floors` then simulates candidate replica counts, smallest first: every autoscaled pool at
its min, then one replica more at a time on the pool the misses point to (TTFT: the prefill or
colocated pool, or decode where the wait for decode pages is most of the TTFT; ITL: the decode
or colocated pool), until a candidate holds TTFT and ITL at the SLO's percentile (TTFT per
request, ITL over every gap between tokens, as the router's histograms count them) or every
pool is at its max. The floors are that candidate's replicas. A candidate whose TTFT misses
exceed what the percentile allows is stopped there (its verdict is known). Every candidate's
figures go back for the decision log.

Bounded cost: at most `max_requests` requests per candidate, and no candidate started after
`budget_s`; a search cut short returns the next candidate it would have tried, a lower bound
(every smaller one missed), with `complete` false.
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from loadgen.metrics import RequestRecord
from loadgen.workloads import Workload, WorkloadRequest, gamma_arrivals
from planning.sim_spec import SimCluster
from planning.simulator import simulate

MAX_REQUESTS = 240   # per candidate: about 0.1-0.3 s of simulation on one core (docs/operations.md)
MIN_REQUESTS = 60    # at a low rate the span grows instead: a percentile needs requests
BUDGET_S = 2.0       # no candidate is started after this many seconds


@dataclass(slots=True)
class Lengths:
    mean: float
    cv: float = 0.0  # standard deviation / mean; 0: every request the mean

    def draw(self, rng: random.Random, n: int, cap: int) -> list[int]:
        if self.cv <= 0:
            return [max(1, min(cap, round(self.mean)))] * n
        s2 = math.log(1.0 + self.cv * self.cv)
        mu = math.log(max(self.mean, 1.0)) - s2 / 2
        return [max(1, min(cap, round(rng.lognormvariate(mu, math.sqrt(s2))))) for _ in range(n)]


@dataclass(slots=True)
class WindowFit:
    """The slow window, fitted: what the synthetic workload is drawn from."""
    rate: float                      # finished requests per second
    prompt: Lengths
    output: Lengths
    prefix_hit: float = 0.0          # fraction of prompt tokens the prefix cache served, 0..1

    @classmethod
    def from_json(cls, d: dict) -> WindowFit:
        return cls(float(d["rate"]), Lengths(**d["prompt"]), Lengths(**d["output"]), float(d.get("prefix_hit", 0.0)))


@dataclass(slots=True)
class Slo:
    ttft_s: float
    itl_s: float
    percentile: float


@dataclass(slots=True)
class Candidate:
    replicas: dict[str, int]         # autoscaled pools only
    ttft_s: float | None             # at the percentile, over every request (unfinished: a miss)
    itl_s: float | None              # at the percentile, over every gap between tokens
    meets: bool
    stopped: bool = False            # cut short once its TTFT misses were past the percentile's allowance
    sim_s: float = 0.0               # wall seconds its simulation took
    grow: str = ""                   # the pool the next candidate grows ("" when it meets)


@dataclass(slots=True)
class FloorResult:
    floors: dict[str, int]
    candidates: list[Candidate]
    complete: bool                   # a candidate met the SLO, or the pools that could help reached their max
    meets: bool                      # the floors' candidate met the SLO
    requests: int                    # per candidate
    span_s: float                    # of the synthetic arrivals
    seconds: float = 0.0             # wall time of the search

    def to_json(self) -> dict:
        return asdict(self)


def synthesize(fit: WindowFit, *, page_size: int, max_model_len: int, max_requests: int = MAX_REQUESTS,
               min_requests: int = MIN_REQUESTS, seed: int = 0) -> Workload:
    """Poisson arrivals at the fitted rate: rate x 60 s requests, within [min_requests,
    max_requests]; lengths lognormal (prompt + output within max_model_len); the first
    prefix_hit x prompt tokens of each prompt (whole pages) one shared prefix."""
    if not fit.rate > 0:
        raise ValueError(f"rate must be > 0, got {fit.rate}")
    if not 0 <= fit.prefix_hit <= 1:
        raise ValueError(f"prefix_hit must be in [0, 1], got {fit.prefix_hit}")
    n = max(min_requests, min(max_requests, round(fit.rate * 60)))
    rng = random.Random(seed)
    outs = fit.output.draw(rng, n, max_model_len - 1)
    prompts = fit.prompt.draw(rng, n, max_model_len - 1)
    arrivals = gamma_arrivals(n, fit.rate, 1.0, seed)
    reqs = []
    for i, (t, p, o) in enumerate(zip(arrivals, prompts, outs)):
        p = min(p, max_model_len - o)
        shared = int(fit.prefix_hit * p) // page_size
        reqs.append(WorkloadRequest(i, t, p, o, tuple(range(shared))))
    return Workload(reqs, page_size if any(r.prefix_blocks for r in reqs) else 0, "autoscale-window",
                    {"request_rate": fit.rate})


def _nearest_rank(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[max(0, math.ceil(q / 100.0 * len(values)) - 1)]


def judge(records: list[RequestRecord], slo: Slo) -> tuple[float | None, float | None, bool]:
    """(TTFT at the percentile, ITL at the percentile, both within the SLO)."""
    ttft = _nearest_rank([r.ttft_s if r.ok and r.ttft_s is not None else math.inf for r in records], slo.percentile)
    itl = _nearest_rank([g for r in records if r.ok for g in r.itls_s], slo.percentile)
    meets = ttft is not None and ttft <= slo.ttft_s and (itl is None or itl <= slo.itl_s)
    return ttft, itl, meets


def _pick(cluster: SimCluster, sizes: dict[str, int], bounds: dict[str, tuple[int, int]], res, slo: Slo,
          ttft: float | None, itl: float | None) -> str:
    """The autoscaled pool below its max the misses point to ("" if none: those that could help are
    at their max)."""
    roles = {p.name: p.role for p in cluster.pools}
    open_ = [n for n in bounds if sizes[n] < bounds[n][1]]
    if not open_:
        return ""
    ttft_miss = ttft is None or ttft > slo.ttft_s
    itl_miss = itl is not None and itl > slo.itl_s
    want: list[str] = []
    if ttft_miss:
        missed = [r for r in res.records if not (r.ok and r.ttft_s is not None and r.ttft_s <= slo.ttft_s)
                  and r.server]
        prefill = sum(r.server.get("prefill_s", 0.0) for r in missed)
        other = sum((r.ttft_s or 0.0) - r.server.get("prefill_s", 0.0) for r in missed)
        first = ("decode", "prefill") if other > prefill else ("prefill", "decode")
        want += ["colocated", *first]
    if itl_miss:  # a prefill pool does not set the gaps between tokens
        want += ["colocated", "decode"]

    def busy(name: str) -> float:
        ws = [w["busy_fraction"] for k, w in res.workers.items() if k.rsplit("-", 1)[0] == name]
        return sum(ws) / len(ws) if ws else 0.0
    for role in want:
        same = [n for n in open_ if roles[n] == role]
        if same:
            return max(same, key=busy)
    return ""


def find_floors(cluster: SimCluster, bounds: dict[str, tuple[int, int]], fit: WindowFit, slo: Slo, *,
                max_model_len: int = 8192, max_requests: int = MAX_REQUESTS, budget_s: float = BUDGET_S,
                seed: int = 0) -> FloorResult:
    """`cluster`: every pool at its current replicas (pools not in `bounds` stay so); `bounds`:
    pool -> (min, max) of the pools to size."""
    t0 = time.perf_counter()
    unknown = set(bounds) - {p.name for p in cluster.pools}
    if unknown:
        raise ValueError(f"bounds name unknown pools {sorted(unknown)}")
    sizes = {n: lo for n, (lo, _) in bounds.items()}
    if fit.rate <= 0:  # nothing arrives: the minimum serves it
        return FloorResult(dict(sizes), [], True, True, 0, 0.0, time.perf_counter() - t0)
    wl = synthesize(fit, page_size=cluster.hash_page_size, max_model_len=max_model_len, max_requests=max_requests,
                    seed=seed)
    n = len(wl.requests)
    allowed = math.floor((1.0 - slo.percentile / 100.0) * n)
    stop = ({"ttft": slo.ttft_s * 1e3}, allowed)
    cands: list[Candidate] = []
    complete, meets = False, False
    while True:
        if cands and time.perf_counter() - t0 > budget_s:
            break
        sim = replace(cluster, pools=[replace(p, replicas=sizes.get(p.name, p.replicas)) for p in cluster.pools])
        res = simulate(sim, wl, stop_after_misses=stop)
        ttft, itl, ok = judge(res.records, slo)
        c = Candidate(dict(sizes), _round(ttft), _round(itl), ok, res.stopped, round(res.wall_s, 3))
        cands.append(c)
        if ok:
            complete = meets = True
            break
        c.grow = _pick(cluster, sizes, bounds, res, slo, ttft, itl)
        if not c.grow:  # the pools that could help are at their max: that is the floor, short of the SLO
            complete = True
            break
        sizes[c.grow] += 1
    span = wl.requests[-1].arrival_s - wl.requests[0].arrival_s
    return FloorResult(dict(sizes), cands, complete, meets, n, round(span, 1), round(time.perf_counter() - t0, 3))


def _round(x: float | None) -> float | None:
    return None if x is None or math.isinf(x) else round(x, 4)


# ---- the process protocol (cluster/autoscale.py) -------------------------------------------------
@dataclass(slots=True)
class FloorRequest:
    config: dict                     # cluster.config.ClusterConfig as JSON, without its autoscale section
    bounds: dict[str, tuple[int, int]]
    profile: dict                    # a `plan profile` JSON, or a LatencyModel's
    window: WindowFit
    slo: Slo
    max_requests: int = MAX_REQUESTS
    budget_s: float = BUDGET_S
    seed: int = 0
    pool_profiles: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict) -> FloorRequest:
        return cls(d["config"], {k: (int(v[0]), int(v[1])) for k, v in d["bounds"].items()}, d["profile"],
                   WindowFit.from_json(d["window"]), Slo(**d["slo"]), int(d.get("max_requests", MAX_REQUESTS)),
                   float(d.get("budget_s", BUDGET_S)), int(d.get("seed", 0)), d.get("pool_profiles") or {})


def run(req: FloorRequest) -> FloorResult:
    from cluster.config import ClusterConfig
    from planning.latency import LatencyModel
    from planning.sim_config import DEFAULT_MAX_MODEL_LEN, sim_cluster

    def model(d: dict) -> LatencyModel:
        return LatencyModel.from_json(d.get("latency_model", d))

    cfg = ClusterConfig.model_validate(req.config)
    profile = model(req.profile)
    cluster = sim_cluster(cfg, profile=profile, pool_profiles={k: model(v) for k, v in req.pool_profiles.items()})
    max_len = cfg.max_model_len or profile.meta.get("max_model_len") or DEFAULT_MAX_MODEL_LEN
    return find_floors(cluster, req.bounds, req.window, req.slo, max_model_len=max_len,
                       max_requests=req.max_requests, budget_s=req.budget_s, seed=req.seed)


def main(argv: list[str] | None = None) -> int:
    """One request JSON on stdin, one line on stdout: the result, or {"error": ...} (exit 1).
    `--nice N`: lower this process's priority by N first (the router's planner asks for 10)."""
    t0 = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--nice":
        import os

        os.nice(int(argv[1]))
    try:
        res = run(FloorRequest.from_json(json.load(sys.stdin)))
    except Exception as exc:  # the caller logs it and keeps its own floor
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    out = res.to_json()
    out["process_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(out, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
