"""The SLA planner (config `autoscale:`, docs/scaling.md "Autoscaling"): one per cluster, in
router 0's actor (cluster.actors.RouterActor.start), on the router's event loop.

Why there: router 0 has every input at hand without an RPC (the dispatcher's worker views, whose
loads its refresh loop keeps current; its own TTFT/ITL histograms and request counters), the
`PoolTargets` the Scale RPC writes, and the Prometheus registry its decisions are exported on.
A target it sets is the same record a Scale call makes, so the driver's scaler
(cluster.runtime.Cluster) resizes the pool with the same warm-up, drain and migration. Ray
restarts a lost router 0 and the supervisor starts it again: the planner comes back with it
(with fresh windows and cooldowns). Its decisions reach the driver's log through
`RouterActor.autoscale_decisions` (the supervisor prints them).

Two loops:

- the fast loop (`interval_s`): per pool, the TTFT and ITL percentiles of the router's requests
  over the last `window_s` (bucket counts of its histograms, differenced between snapshots) and,
  for decode and colocated pools, the step-time estimate of ITL from the workers' reports
  (running requests / tokens per second: one token per running sequence per step), plus the
  workers' KV use and waiting requests. One replica up when an estimate misses the SLO or KV or
  queue pressure is high (after `up_cooldown_s`, within max_replicas and `budget_cpus`); one down
  when the estimates scaled to one replica fewer stay under `down_fraction` of the SLO, after
  `down_cooldown_s`, not below min_replicas nor the slow loop's floor. At zero traffic (no request
  in the window, nothing running or waiting) pools go to min_replicas. A pool that needs a
  replica takes one from a pool that can spare it, where their workers are built alike: a move
  (a running worker's role switch, cluster.scaler) instead of a new process.
- the slow loop (`slow_interval_s`): over its window, the arrival rate lambda (finished requests
  per second), mean prompt and output tokens and mean time in the system W. With `floor:
  littles_law` (the default), Little's law gives the requests in the system L = lambda * W, and a
  pool's floor is the replicas whose batches hold them: ceil(L / max_num_seqs) for decode and
  colocated pools, ceil(lambda * mean prefill time / (max_num_batched_tokens // mean prompt)) for
  prefill pools. With `floor: simulator`, planning's simulator sets them (planning/floor.py): the
  window's fit (rate, length means and coefficients of variation and the prefix-hit rate, these
  from the router's request log lines: autoscale_window.RequestSamples) goes with the config, the
  pools' targets and reported KV pages and the profile (`autoscale.profile`, read when the config
  was loaded) to `python -m planning.floor`, a process of its own (autoscale_floor.run_floor:
  planning sits above cluster in the package layers, and its CPU stays off this event loop, which
  only awaits the answer). One evaluation at a time; the floors stay as they were until it
  answers, and where it fails or passes `floor_timeout_s` (the process is killed), Little's law's
  floors apply and the reason is logged. Either way one `autoscale_floor` line carries the
  window, both floors and each simulated candidate's TTFT and ITL.

`Planner` is the decision logic alone (no I/O, a clock passed in): tests/unit/test_autoscale.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field

from cluster.autoscale_floor import FloorFailed, floor_request, run_floor
from cluster.autoscale_window import RequestSamples, Window
from cluster.config import AutoscaleSettings, ClusterConfig, PoolConfig
from cluster.scaler import move_refusals

log = logging.getLogger("pdcluster.autoscale")


@dataclass(slots=True)
class PoolSignal:
    """One pool's inputs to a fast-loop tick."""
    target: int                      # the pool's target now (PoolTargets)
    current: int                     # its serving workers now (the driver's count)
    running: int = 0                 # requests in its workers' batches
    waiting: int = 0                 # requests waiting on its workers (queue, pages, KV)
    queued_tokens: int = 0           # prompt tokens still to prefill
    kv_used: float = 0.0             # mean fraction of KV pages in use over its workers
    step_itl_s: float | None = None  # step-time estimate of ITL (running / tokens_per_s), decode and colocated
    ttft_s: float | None = None      # the router's TTFT percentile over the window (None: no sample)
    itl_s: float | None = None       # the router's ITL percentile over the window
    requests: int = 0                # requests that got a first token in the window


@dataclass(slots=True)
class Decision:
    pool: str
    direction: str                   # up, down, move (a worker of inputs["from"] moves here), hold (an up
                                     # wanted but not made)
    reason: str                      # min, floor, max, ttft_slo, itl_slo, kv_pressure, queue, idle, under_slo;
                                     # hold: at_max, budget, cooldown
    target: int
    desired: int
    inputs: dict = field(default_factory=dict)


@dataclass(slots=True)
class _PoolState:
    last_change: float | None = None  # when its target last changed (ours or a Scale call)
    last_target: int | None = None
    floor: int = 1
    blocked: str = ""                 # the hold reason logged last (logged once until it changes)
    settling: bool = False            # its serving workers differ from its target (the scaler is at work)


def replica_cpus(pool: PoolConfig) -> float:
    return pool.resources.num_cpus * pool.engine.tensor_parallel_size


class Planner:
    """The decision logic of both loops; `tick` returns the decisions of one fast-loop step."""

    def __init__(self, settings: AutoscaleSettings, pools: list[PoolConfig], applies: bool = True) -> None:
        self.s = settings
        self.applies = applies  # mode on: a decision becomes the target (advisory: the target stays)
        self.wanted: dict[str, int] = {}  # pool -> replicas wanted after the last tick (the desired metric)
        self.pools = {p.name: p for p in pools}
        self.state = {name: _PoolState(floor=ap.min_replicas) for name, ap in settings.pools.items()}
        # (from, to) pairs of pools that cannot trade workers (cluster.scaler.move_refusal)
        self.refusals = set(move_refusals(pools))

    # ---- the slow loop -------------------------------------------------------------------------
    def littles_law_floors(self, stats: dict) -> dict[str, int]:
        """Floors from the slow window's statistics (`Window.slow`) by Little's law, within each
        pool's min and max; not applied."""
        rate, e2e = stats.get("rate", 0.0), stats.get("e2e_s", 0.0)
        prompt, prefill = stats.get("prompt_tokens", 0.0), stats.get("prefill_s", 0.0)
        floors = {}
        for name in self.s.pools:
            p = self.pools[name]
            if p.role == "prefill":
                per = max(1, p.engine.max_num_batched_tokens // max(1, int(prompt or 1)))
                need = rate * prefill / per
            else:
                need = rate * e2e / p.engine.max_num_seqs
            floors[name] = math.ceil(need - 1e-9)
        return self.clamp(floors)

    def clamp(self, floors: dict[str, int]) -> dict[str, int]:
        """Each autoscaled pool's floor within its min and max (its min where `floors` has none)."""
        return {name: min(max(int(floors.get(name, ap.min_replicas)), ap.min_replicas), ap.max_replicas)
                for name, ap in self.s.pools.items()}

    def apply_floors(self, floors: dict[str, int]) -> dict[str, int]:
        floors = self.clamp(floors)
        for name, floor in floors.items():
            self.state[name].floor = floor
        return floors

    def set_floors(self, stats: dict) -> dict[str, int]:
        """Little's law's floors, applied."""
        return self.apply_floors(self.littles_law_floors(stats))

    # ---- the fast loop -------------------------------------------------------------------------
    def tick(self, signals: dict[str, PoolSignal], now: float) -> list[Decision]:
        """One fast-loop step. A pool that needs a replica more takes one from a pool that can
        spare one (its estimates at one replica fewer stay under `down_fraction` of the SLO, or
        it is idle; its last change at least `up_cooldown_s` ago) and whose workers are built
        alike (cluster.scaler.move_refusal): a move, which switches a running worker's role in
        a second instead of starting a process; else it scales out, within max and budget."""
        s, out = self.s, []
        used = sum(replica_cpus(p) * ((signals[n].target if n in signals else p.replicas) + p.spare_replicas)
                   for n, p in self.pools.items())
        looks = {}
        for name in s.pools:
            sig = signals.get(name)
            if sig is None:
                continue
            st = self.state[name]
            t = sig.target
            if st.last_target != t:  # a change (not ours: a Scale call, or the start): cooldowns count from now
                st.last_change, st.last_target = now, t
            self.wanted[name] = t
            if sig.current != t:  # the scaler is still moving it: one step at a time
                st.settling = True
                continue
            if st.settling:  # it got there: the cooldowns count from the new size serving
                st.settling, st.last_change = False, now
            looks[name] = self._look(name, sig, now)
        donors = [n for n, lk in looks.items() if not lk["up"] and lk["spare"] and lk["since"] >= s.up_cooldown_s]
        given: set[str] = set()
        for name in sorted(looks, key=lambda n: not looks[n]["up"]):  # the pools that want more first
            if name in given:
                continue
            lk, st, pool = looks[name], self.state[name], self.pools[name]
            t, hi, up, since = lk["t"], lk["hi"], lk["up"], lk["since"]
            inputs = {**lk["inputs"], "cpus_used": used, "budget_cpus": s.budget_cpus}
            d = None
            if up:
                cost = replica_cpus(pool)
                if t >= hi:
                    blocked = "at_max"
                elif up not in ("min", "floor") and since < s.up_cooldown_s:
                    blocked = "cooldown"
                elif s.budget_cpus is not None and used + cost > s.budget_cpus + 1e-9:
                    blocked = "budget"
                else:
                    blocked = ""
                donor = next((y for y in donors if y != name and y not in given
                              and (y, name) not in self.refusals), None) if blocked in ("", "budget") else None
                if donor is not None:  # a move: no new process, no CPUs more
                    given.add(donor)
                    dt = looks[donor]["t"]
                    d = Decision(name, "move", up, t, t + 1, {**inputs, "from": donor, "from_target": dt,
                                                                "from_inputs": looks[donor]["inputs"]})
                    self.wanted[donor] = dt - 1
                    self.state[donor].last_change = now
                    self.state[donor].blocked = ""
                    if self.applies:
                        self.state[donor].last_target = dt - 1
                else:
                    if blocked in ("", "cooldown"):
                        self.wanted[name] = t + 1
                    if blocked:
                        if st.blocked != blocked:
                            st.blocked = blocked
                            out.append(Decision(name, "hold", blocked, t, t, {**inputs, "wanted": up}))
                        continue
                    used += cost
                    d = Decision(name, "up", up, t, t + 1, inputs)
            elif t > hi:
                d = Decision(name, "down", "max", t, t - 1, inputs)
            elif lk["spare"] and since >= s.down_cooldown_s:
                used -= replica_cpus(pool)
                d = Decision(name, "down", "idle" if lk["idle"] else "under_slo", t, t - 1, inputs)
            st.blocked = ""
            if d is not None:
                out.append(d)
                self.wanted[name] = d.desired
                st.last_change = now
                if self.applies:
                    st.last_target = d.desired
        return out

    def _look(self, name: str, sig: PoolSignal, now: float) -> dict:
        """A pool's estimates against the SLO: why it needs a replica more ("" if not), whether it
        could spare one (idle, or its estimates scaled to one replica fewer under down_fraction
        of the SLO, above its min and floor), and the inputs its decision line shows."""
        s, ap, st, pool = self.s, self.s.pools[name], self.state[name], self.pools[name]
        t = sig.target
        lo, hi = max(ap.min_replicas, st.floor), ap.max_replicas
        ttft = sig.ttft_s if pool.role != "decode" else None
        itl = None
        if pool.role != "prefill":
            cands = [x for x in (sig.itl_s, sig.step_itl_s) if x is not None]
            itl = max(cands) if cands else None
        waiting_per = sig.waiting / max(sig.current, 1)
        inputs = {"target": t, "current": sig.current, "min": ap.min_replicas, "max": hi, "floor": st.floor,
                  "ttft_s": _r(ttft), "itl_s": _r(itl), "router_itl_s": _r(sig.itl_s),
                  "step_itl_s": _r(sig.step_itl_s), "slo_ttft_s": s.slo.ttft_s, "slo_itl_s": s.slo.itl_s,
                  "percentile": s.slo.percentile, "requests": sig.requests, "running": sig.running,
                  "waiting": sig.waiting, "queued_tokens": sig.queued_tokens, "kv_used": round(sig.kv_used, 3)}
        up = ""
        if t < ap.min_replicas:
            up = "min"
        elif t < st.floor:
            up = "floor"
        elif ttft is not None and ttft > s.slo.ttft_s:
            up = "ttft_slo"
        elif itl is not None and itl > s.slo.itl_s:
            up = "itl_slo"
        elif sig.kv_used >= s.kv_high:
            up = "kv_pressure"
        elif waiting_per >= s.queue_high:
            up = "queue"
        idle = spare = False
        if not up and lo < t <= hi:
            f = t / (t - 1)
            idle = sig.requests == 0 and sig.running == 0 and sig.waiting == 0
            spare = idle or (sig.waiting == 0 and (ttft or 0.0) * f < s.down_fraction * s.slo.ttft_s
                             and (itl or 0.0) * f < s.down_fraction * s.slo.itl_s and sig.kv_used * f < s.kv_high)
        return {"t": t, "lo": lo, "hi": hi, "up": up, "since": now - st.last_change, "idle": idle, "spare": spare,
                "inputs": inputs}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# ---- the planner in router 0 --------------------------------------------------------------------
class Autoscaler:
    """Runs `Planner` on a router: inputs from its dispatcher's views and its metrics, decisions
    logged (logger pdcluster.autoscale, one JSON line each), counted and, in mode `on`, set as
    the pools' targets (router.service.PoolTargets.set: what the Scale RPC does)."""

    def __init__(self, config: ClusterConfig, service, targets, clock=time.monotonic) -> None:
        from prometheus_client import Counter, Gauge

        self.s, self.config = config.autoscale, config
        self.service, self.targets, self.clock = service, targets, clock
        self.pools = {p.name: p for p in config.pools}
        self.planner = Planner(self.s, config.pools, applies=self.s.mode == "on")
        self.window = Window(service.metrics, keep_s=max(self.s.window_s, self.s.slow_interval_s) + self.s.interval_s)
        reg = service.metrics.registry
        self.desired = Gauge("pdcluster_autoscale_desired_replicas", "replicas the SLA planner wants for the pool "
                             "(in advisory mode too)", ["pool"], registry=reg)
        self.decisions_total = Counter("pdcluster_autoscale_decisions", "SLA planner decisions (hold: an up wanted "
                                       "but not made)", ["pool", "direction", "reason"], registry=reg)
        self.floor_replicas = Gauge("pdcluster_autoscale_floor_replicas", "the slow loop's floor of the pool's "
                                    "replicas", ["pool"], registry=reg)
        self.floor_seconds = Gauge("pdcluster_autoscale_floor_evaluation_seconds", "wall time of the last "
                                   "simulator floor evaluation (its process included)", registry=reg)
        self.floor_evaluations = Counter("pdcluster_autoscale_floor_evaluations", "simulator floor evaluations by "
                                         "outcome (ok, error, timeout, busy)", ["outcome"], registry=reg)
        self.lines: deque = deque(maxlen=256)   # (seq, JSON line) of the latest decisions
        self.seq = 0
        self.floors: dict[str, int] = {}
        self.samples = RequestSamples(clock)     # request lengths and cached tokens (floor simulator)
        self._last_slow: float | None = None
        self._task: asyncio.Task | None = None
        self.floor_task: asyncio.Task | None = None  # the simulator floor evaluation in flight

    def start(self) -> None:
        if self.s.floor == "simulator":
            self.samples.attach()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pdcluster-autoscale")

    async def stop(self) -> None:
        self.samples.detach()
        for task in (self._task, self.floor_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._task = self.floor_task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.s.interval_s)
            try:
                self.step()
            except Exception as exc:  # the planner never takes the router down
                log.warning("autoscale step: %s: %s", type(exc).__name__, exc)

    def signals(self, now: float) -> dict[str, PoolSignal]:
        fast = self.window.fast(now, self.s.window_s, self.s.slo.percentile)
        status = self.targets.status.get("pools", {})
        views = list(self.service.dispatcher.views.values())
        out = {}
        for name in self.s.pools:
            serving = [v for v in views if v.pool == name and v.state == "serving"]
            loads = [v.load for v in serving if v.load is not None]
            pushed = status.get(name)
            current = pushed["current"] if pushed is not None else len(serving)
            steps = [ld.running_requests / ld.tokens_per_s for ld in loads
                     if ld.running_requests and ld.tokens_per_s > 0]
            kv = [(ld.total_pages - ld.free_pages) / ld.total_pages for ld in loads if ld.total_pages]
            out[name] = PoolSignal(
                target=self.targets.target(name), current=current,
                running=sum(ld.running_requests for ld in loads), waiting=sum(ld.waiting_requests for ld in loads),
                queued_tokens=sum(ld.queued_tokens for ld in loads), kv_used=sum(kv) / len(kv) if kv else 0.0,
                step_itl_s=sum(steps) / len(steps) if steps else None,
                ttft_s=fast["ttft_s"], itl_s=fast["itl_s"], requests=fast["requests"])
        return out

    def step(self) -> list[Decision]:
        now = self.clock()
        self.window.snapshot(now)
        if self._last_slow is None:
            self._last_slow = now
        elif now - self._last_slow >= self.s.slow_interval_s:
            self._last_slow = now
            self.slow_step(now)
        decisions = self.planner.tick(self.signals(now), now)
        for name, n in self.planner.wanted.items():
            self.desired.labels(pool=name).set(n)
        self.apply(decisions)
        return decisions

    def apply(self, decisions: list[Decision]) -> None:
        """Log and count each decision; in mode on, set it as the pools' targets (a move as the
        Scale RPC's move: router.service.PoolTargets.move)."""
        for d in decisions:
            applied = False
            extra = {}
            if d.direction in ("up", "down"):
                if self.s.mode == "on":
                    self.targets.set(d.pool, d.desired)
                    applied = True
            elif d.direction == "move" and self.s.mode == "on":
                why = self.targets.check_move(d.inputs["from"], d.pool, 1)
                if why is None:
                    self.targets.move(d.inputs["from"], d.pool, 1)
                    applied = True
                else:  # e.g. a Scale call changed the targets meanwhile
                    extra["refused"] = why
            self.decisions_total.labels(pool=d.pool, direction=d.direction, reason=d.reason).inc()
            self._emit({"event": "autoscale", "mode": self.s.mode, **asdict(d), "applied": applied, **extra})

    # ---- the slow loop -------------------------------------------------------------------------
    def slow_step(self, now: float) -> None:
        """Little's law's floors at once; with floor simulator, an evaluation started instead
        (`floor_task`), whose floors (or, when it fails, Little's law's) apply when it ends."""
        stats = self.window.slow(now, self.s.slow_interval_s)
        littles = self.planner.littles_law_floors(stats)
        line = {"event": "autoscale_floor", "mode": self.s.mode, "source": "littles_law", "window": stats}
        if self.s.floor != "simulator":
            self._set_floors(littles)
            self._emit({**line, "floors": self.floors})
            return
        stats.update(self.samples.spread(now, stats.get("seconds") or self.s.slow_interval_s))  # the same span
        if self.floor_task is not None and not self.floor_task.done():  # the floors stay as they are
            self.floor_evaluations.labels(outcome="busy").inc()
            self._emit({**line, "source": "unchanged", "floors": self.floors, "littles_law": littles,
                        "simulator": {"skipped": "the previous evaluation is still running"}})
            return
        if not stats.get("rate"):  # nothing to simulate: Little's law gives each pool its min
            self._set_floors(littles)
            self._emit({**line, "floors": self.floors, "littles_law": littles,
                        "simulator": {"skipped": "no request finished in the window"}})
            return
        request = floor_request(self.config, {n: self.targets.target(n) for n in self.pools}, self._pages(),
                                self._fit(stats), self.s.floor_budget_s)
        self.floor_task = asyncio.get_running_loop().create_task(self._simulate(line, littles, request),
                                                                 name="pdcluster-autoscale-floor")

    @staticmethod
    def _fit(stats: dict) -> dict:
        """The window as planning.floor.WindowFit reads it (no spread observed: every request the mean)."""
        return {"rate": stats["rate"],
                "prompt": {"mean": stats.get("prompt_tokens", 0.0), "cv": stats.get("prompt_cv") or 0.0},
                "output": {"mean": stats.get("output_tokens", 0.0), "cv": stats.get("output_cv") or 0.0},
                "prefix_hit": stats.get("prefix_hit") or 0.0}

    def _pages(self) -> dict[str, int]:
        """KV pages per replica as each pool's serving workers report them."""
        out: dict[str, int] = {}
        for v in self.service.dispatcher.views.values():
            if v.load is not None and v.load.total_pages:
                out[v.pool] = max(out.get(v.pool, 0), v.load.total_pages)
        return out

    async def _simulate(self, line: dict, littles: dict[str, int], request: dict) -> None:
        t0 = time.monotonic()
        try:
            answer = await run_floor(request, self.s.floor_timeout_s)
        except Exception as exc:  # FloorFailed, or the process could not start: never the router's problem
            outcome = exc.outcome if isinstance(exc, FloorFailed) else "error"
            sim, floors = {"error": f"{outcome}: {exc}" if isinstance(exc, FloorFailed)
                           else f"{outcome}: {type(exc).__name__}: {exc}"}, littles
            log.warning("autoscale floor: the simulator's evaluation failed (%s); Little's law's floors %s apply",
                        sim["error"], littles)
        else:
            outcome, floors, line = "ok", answer["floors"], {**line, "source": "simulator"}
            sim = {k: answer.get(k) for k in ("floors", "meets", "complete", "requests", "span_s", "seconds",
                                              "process_s", "candidates")}
        sim["wall_s"] = round(time.monotonic() - t0, 3)
        self.floor_seconds.set(sim["wall_s"])
        self.floor_evaluations.labels(outcome=outcome).inc()
        self._set_floors(floors)
        self._emit({**line, "floors": self.floors, "littles_law": littles, "simulator": sim})

    def _set_floors(self, floors: dict[str, int]) -> None:
        self.floors = self.planner.apply_floors(floors)
        for name, n in self.floors.items():
            self.floor_replicas.labels(pool=name).set(n)

    def _emit(self, fields: dict) -> None:
        line = json.dumps(fields, separators=(",", ":"))
        self.seq += 1
        self.lines.append((self.seq, line))
        log.info("%s", line)

    def since(self, seq: int) -> list[tuple[int, str]]:
        return [(n, line) for n, line in self.lines if n > seq]
