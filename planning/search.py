"""The planner: which pools, on which hardware, with what parallelism, meet the SLOs best.

Goodput follows DistServe: the highest request rate at which at least `attainment` of the
requests meet every SLO (per request: TTFT, TPOT, ...), times that fraction. The workload
is replayed long enough at each rate (`evaluate`) that an overloaded cluster's backlog
shows as missed SLOs instead of draining after a short trace. The search has DistServe's shape:

1. Instance capacity. For every instance shape (GPU type x TP degree that fits the model),
   simulate one instance on the workload, the other phase taking no time (a prefill
   instance with free decode, a decode instance with free prefill but its KV transfer), and
   search the offered rate for its goodput under every SLO (a backlog of decode shows in
   TTFT too: the router reserves decode pages before the prefill starts).
2. Pool sizing. A disaggregated config of n_p prefill and n_d decode instances is estimated
   at min(n_p * prefill goodput, n_d * decode goodput); a colocated one at n * its goodput.
   Every split that fits the inventory (GPUs per type, total) is scored without simulation.
   Replicas behind one router share their queue, so the estimate is a little conservative.
3. Verification. The best `verify` configs by the objective are simulated whole (router,
   queues, transfers, both pools together): their goodput is bisected again end to end, and
   their SLO attainment at the workload's own rate is reported.

Costs are the hardware's price per GPU-hour (defaults in hardware.py; pass your own).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from loadgen.metrics import meets_slo
from loadgen.workloads import Workload
from planning.latency import LatencyModel
from planning.sim_request import EngineLimits
from planning.sim_spec import SimCluster, SimPool
from planning.simulator import simulate

FREE = LatencyModel()  # a phase that takes no time: isolates the other one
OBJECTIVES = ("goodput", "per-gpu", "per-dollar")


@dataclass(slots=True, frozen=True)
class Instance:
    """One replica's shape: what it runs on, how many GPUs, its step times and pages."""
    gpu: str
    tp: int
    latency: LatencyModel
    num_pages: int
    price_per_hour: float           # the whole replica (tp GPUs)

    @property
    def label(self) -> str:
        return f"{self.gpu}" + (f" tp{self.tp}" if self.tp > 1 else "")


@dataclass(slots=True)
class Plan:
    mode: str                       # disaggregated | colocated
    pools: list[tuple[str, int, Instance]]   # (role, replicas, instance)
    estimate: float                 # goodput estimated from instance capacities (req/s)
    goodput: float | None = None    # verified end to end
    attainment: float | None = None  # at the workload's own rate
    verified: bool = False

    @property
    def gpus(self) -> int:
        return sum(n * inst.tp for _, n, inst in self.pools)

    @property
    def price_per_hour(self) -> float:
        return sum(n * inst.price_per_hour for _, n, inst in self.pools)

    @property
    def best_goodput(self) -> float:
        return self.goodput if self.goodput is not None else self.estimate

    def gpus_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, n, inst in self.pools:
            out[inst.gpu] = out.get(inst.gpu, 0) + n * inst.tp
        return out

    def describe(self) -> str:
        return " + ".join(f"{n}x{role[0].upper()}[{inst.label}]" for role, n, inst in self.pools)

    def score(self, objective: str) -> float:
        g = self.best_goodput
        if objective == "per-gpu":
            return g / self.gpus if self.gpus else 0.0
        if objective == "per-dollar":
            return g / self.price_per_hour if self.price_per_hour else g
        return g


@dataclass(slots=True)
class SearchSpace:
    instances: list[Instance]
    inventory: dict[str, int]       # GPU type -> GPUs available
    max_gpus: int
    modes: tuple[str, ...] = ("disaggregated", "colocated")
    prefill_limits: EngineLimits = field(default_factory=lambda: EngineLimits(16, 1, 8192, 256))
    decode_limits: EngineLimits = field(default_factory=lambda: EngineLimits(16, 1, 8192, 256))
    transport: str = "nixl"
    max_inflight: int = 1 << 16
    exact_steps: bool = False       # simulate every decode step as its own event (validation; slower)


# ---- goodput of one simulated cluster --------------------------------------------------------
SPAN_OVER_LATENCY = 8       # replay at least this many median E2E latencies of arrivals
MAX_REQUESTS = 40000


def rescale(workload: Workload, rate: float, min_span_s: float = 0.0) -> Workload:
    """The requests with arrival times stretched to `rate` requests/s on average, the trace
    cycled (prefix block ids made new each cycle) until arrivals span `min_span_s`."""
    reqs = workload.requests
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    base = (len(reqs) - 1) / span if span > 0 else float("inf")
    k = base / rate if math.isfinite(base) else 0.0
    period = len(reqs) / rate
    cycles = min(max(1, math.ceil(min_span_s / period)), max(1, MAX_REQUESTS // len(reqs)))
    top = 1 + max((b for r in reqs for b in r.prefix_blocks), default=0)
    out = [replace(r, index=c * len(reqs) + r.index, arrival_s=c * period + r.arrival_s * k,
                   prefix_blocks=tuple(b + c * top for b in r.prefix_blocks))
           for c in range(cycles) for r in reqs]
    return Workload(out, workload.block_tokens, workload.name, dict(workload.meta, request_rate=rate))


def max_misses(n: int, target: float) -> int:
    """The most requests of n that may miss an SLO with the attainment still >= target."""
    m = max(int(n * (1.0 - target)) + 2, 0)
    while m > 0 and (n - m) / n < target:
        m -= 1
    return m if (n - m) / n >= target else -1


def evaluate(cluster: SimCluster, workload: Workload, slo: dict[str, float], rate: float,
             target: float | None = None) -> float:
    """SLO attainment at an offered rate. A short trace offered too fast only queues and
    drains, so the trace is replayed until its arrivals span SPAN_OVER_LATENCY median
    latencies: a backlog that grows shows up as missed SLOs. With `target`, that replay stops
    as soon as more requests have missed than the target allows (an overloaded cluster's
    verdict is known long before its backlog drains); the attainment returned is then below
    the target (requests left unfinished count as misses), as the whole replay's would be."""
    res = simulate(cluster, rescale(workload, rate))
    e2e = sorted(r.e2e_s for r in res.records if r.ok)
    need = SPAN_OVER_LATENCY * (e2e[len(e2e) // 2] if e2e else 0.0)
    if need > len(workload.requests) / rate:
        long = rescale(workload, rate, need)
        stop = None if target is None else (slo, max_misses(len(long.requests), target))
        res = simulate(cluster, long, stop_after_misses=stop)
    return sum(meets_slo(r, slo) for r in res.records) / len(res.records)


def max_goodput(cluster: SimCluster, workload: Workload, slo: dict[str, float], target: float,
                start_rate: float, iters: int = 6) -> float:
    """Goodput: the highest offered rate with attainment >= target, times that attainment;
    found by doubling the rate until attainment fails, then bisecting in log space."""
    best, lo, hi = 0.0, 0.0, start_rate
    while (att := evaluate(cluster, workload, slo, hi, target)) >= target:
        best, lo, hi = hi * att, hi, hi * 2
        if hi > start_rate * 2 ** 12:
            return best
    if lo == 0.0:
        lo = hi / 2 ** 10
        att = evaluate(cluster, workload, slo, lo, target)
        if att < target:
            return 0.0
        best = lo * att
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        att = evaluate(cluster, workload, slo, mid, target)
        if att >= target:
            lo, best = mid, mid * att
        else:
            hi = mid
    return best


# ---- step 1: instance capacities ---------------------------------------------------------------
def _pool(role: str, n: int, inst: Instance, limits: EngineLimits) -> SimPool:
    return SimPool(f"{role}-{inst.gpu}-tp{inst.tp}".lower(), role, n, inst.latency,
                   replace(limits, num_pages=inst.num_pages), hardware=inst.label, gpus_per_replica=inst.tp,
                   price_per_hour=inst.price_per_hour)


def _free_pool(role: str, limits: EngineLimits, transfer_from: LatencyModel | None = None) -> SimPool:
    lm = FREE if transfer_from is None else replace(FREE, transfer_overhead_s=transfer_from.transfer_overhead_s,
                                                     transfer_bytes_per_s=transfer_from.transfer_bytes_per_s,
                                                     kv_bytes_per_token=transfer_from.kv_bytes_per_token,
                                                     num_layers=transfer_from.num_layers)
    return SimPool(f"free-{role}", role, 1, lm, replace(limits, num_pages=1 << 30, max_num_seqs=1 << 20))


def instance_goodput(role: str, inst: Instance, space: SearchSpace, workload: Workload, slo: dict[str, float],
                     target: float, start_rate: float) -> float:
    if role == "prefill":
        pools = [_pool("prefill", 1, inst, space.prefill_limits), _free_pool("decode", space.decode_limits)]
    elif role == "decode":
        pools = [_free_pool("prefill", space.prefill_limits, inst.latency), _pool("decode", 1, inst, space.decode_limits)]
    else:
        pools = [_pool("colocated", 1, inst, space.decode_limits)]
    cluster = SimCluster(pools, policy="least-loaded", max_inflight=space.max_inflight, max_queue=1 << 30,
                         transport=space.transport, exact_steps=space.exact_steps)
    return max_goodput(cluster, workload, slo, target, start_rate)


# ---- steps 2 and 3: sizing and verification ------------------------------------------------------
def _fits(counts: dict[str, int], space: SearchSpace) -> bool:
    return sum(counts.values()) <= space.max_gpus and all(n <= space.inventory.get(g, 0) for g, n in counts.items())


def enumerate_plans(space: SearchSpace, capacity: dict[tuple[str, int], float]) -> list[Plan]:
    """capacity: (role, instance index) -> instance goodput. Every count split that fits."""
    plans = []
    insts = space.instances
    if "colocated" in space.modes:
        for i, inst in enumerate(insts):
            cap = capacity[("colocated", i)]
            for n in range(1, space.max_gpus // inst.tp + 1):
                p = Plan("colocated", [("colocated", n, inst)], n * cap)
                if _fits(p.gpus_by_type(), space):
                    plans.append(p)
    if "disaggregated" in space.modes:
        for i, pi in enumerate(insts):
            for j, di in enumerate(insts):
                cp, cd = capacity[("prefill", i)], capacity[("decode", j)]
                for n_p in range(1, space.max_gpus // pi.tp + 1):
                    for n_d in range(1, (space.max_gpus - n_p * pi.tp) // di.tp + 1):
                        p = Plan("disaggregated", [("prefill", n_p, pi), ("decode", n_d, di)], min(n_p * cp, n_d * cd))
                        if _fits(p.gpus_by_type(), space):
                            plans.append(p)
    return plans


def plan_cluster(plan: Plan, space: SearchSpace) -> SimCluster:
    limits = {"prefill": space.prefill_limits, "decode": space.decode_limits, "colocated": space.decode_limits}
    return SimCluster([_pool(role, n, inst, limits[role]) for role, n, inst in plan.pools], policy="prefix-aware",
                      max_inflight=space.max_inflight, max_queue=1 << 30, transport=space.transport,
                      exact_steps=space.exact_steps)


def _verify(plan: Plan, space: SearchSpace, workload: Workload, slo: dict[str, float], target: float,
            rate: float) -> tuple[float, float]:
    cluster = plan_cluster(plan, space)
    goodput = max_goodput(cluster, workload, slo, target, max(plan.estimate, rate * 0.1))
    recs = simulate(cluster, workload).records
    return goodput, sum(meets_slo(r, slo) for r in recs) / len(recs)


def _map(fn, args: list[tuple], jobs: int):
    """fn(*a) for each a, in order, over `jobs` processes (1: here); yields as they complete, in order."""
    if jobs <= 1 or len(args) <= 1:
        for a in args:
            yield fn(*a)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
    with ProcessPoolExecutor(max_workers=min(jobs, len(args)), mp_context=ctx) as pool:
        for f in [pool.submit(fn, *a) for a in args]:
            yield f.result()


def default_jobs() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def search(space: SearchSpace, workload: Workload, slo: dict[str, float], *, target: float = 0.9,
           objective: str = "per-dollar", verify: int = 6, progress: Callable[[str], None] = lambda s: None,
           jobs: int = 1) -> list[Plan]:
    """Ranked plans (verified ones first, by the objective). `workload` carries the rate the
    user serves; its attainment is reported for every verified plan. `jobs`: simulations run
    in that many processes at once (instance capacities, then verifications); the result does
    not depend on it."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if not 0 < target <= 1:
        raise ValueError(f"attainment target must be in (0, 1], got {target}")
    if not slo:
        raise ValueError("give at least one SLO (e.g. ttft:2000 tpot:100)")
    if len(workload.requests) < 2:
        raise ValueError("the workload needs at least 2 requests")
    reqs = workload.requests
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    rate = (len(reqs) - 1) / span if span > 0 else 1.0
    roles = (("prefill", "decode") if "disaggregated" in space.modes else ()) + \
        (("colocated",) if "colocated" in space.modes else ())
    capacity = {}
    keys = [(role, i) for i in range(len(space.instances)) for role in roles]
    args = [(role, space.instances[i], space, workload, slo, target, rate) for role, i in keys]
    for (role, i), cap in zip(keys, _map(instance_goodput, args, jobs)):
        capacity[(role, i)] = cap
        progress(f"instance {role:<9} {space.instances[i].label:<12} goodput {cap:.3f} req/s")
    plans = [p for p in enumerate_plans(space, capacity) if p.estimate > 0]
    plans.sort(key=lambda p: (-p.score(objective), p.price_per_hour, p.gpus))
    picked = _diverse(plans, verify)
    for p, (goodput, attainment) in zip(picked, _map(_verify, [(p, space, workload, slo, target, rate)
                                                                for p in picked], jobs)):
        p.goodput, p.attainment = goodput, attainment
        p.verified = True
        progress(f"verified  {p.describe():<40} goodput {p.goodput:.3f} req/s (estimate {p.estimate:.3f})")
    plans.sort(key=lambda p: (not p.verified, -p.score(objective), p.price_per_hour, p.gpus))
    return plans


def _diverse(plans: list[Plan], k: int) -> list[Plan]:
    """The best k plans, at most one per (mode, hardware) shape, then the next best."""
    seen, picked = set(), []
    for p in plans:
        shape = (p.mode, tuple((role, inst.label) for role, _, inst in p.pools))
        if shape not in seen:
            seen.add(shape)
            picked.append(p)
        if len(picked) == k:
            return picked
    return picked + [p for p in plans if p not in picked][: k - len(picked)]


def pareto_front(plans: list[Plan]) -> list[Plan]:
    """Plans no other plan beats on both price (lower) and goodput (higher)."""
    front, best = [], -1.0
    for p in sorted(plans, key=lambda p: (p.price_per_hour, -p.best_goodput)):
        if p.best_goodput > best:
            front.append(p)
            best = p.best_goodput
    return front
