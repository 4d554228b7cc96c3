"""Discrete-event simulation of the cluster serving a workload.

The same request way as the real cluster (DESIGN.md), with step times from a `LatencyModel`
per pool instead of tensors:

    arrival -> router admission (max_inflight running, max_queue waiting, else rejected)
    -> decode pick (policy) -> destination pages reserved at the worker's next step boundary
       (it takes calls between steps), or QUEUED_FOR_PAGES until free;
       an uncached prompt under local_prefill_threshold, or a colocated worker: LOCAL_PREFILL
    -> prefill pick (policy) -> prefill engine (batching, chunks, prefix cache) -> first token
       (TTFT) -> KV transfer on the prefill worker's link, layer by layer behind the last step
    -> decode engine (continuous batching, pages, preemption by recompute) -> one token per
       step -> finished: pages and the router slot come back.

Every worker is an `EngineSim` (sim_engine.py): the engine's own scheduler, in step times.
The output is what `bench serve` measures on a real endpoint: one `RequestRecord` per request
(TTFT, chunk times, tokens, server timings and placement), so `loadgen.metrics.summarize`
gives the same table and JSON, plus per-worker statistics.

The transfer of a request's KV starts with its last prefill step (layers are sent as each is
computed) and ends no earlier than one layer's share after that step; transfers from one
prefill worker share its link, first come first served.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from loadgen.client import Timeline
from loadgen.metrics import RequestRecord, meets_slo
from loadgen.workloads import Workload
from planning.sim_engine import EngineSim
from planning.sim_request import SimRequest
from planning.sim_router import RouterView, SimLoad, SimView, to_sim_requests
from planning.sim_spec import SimCluster
from planning.sim_store import KVTier, tier_summary
from router.policy import make_policy

@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float
    timeline: Timeline
    workers: dict[str, dict]
    wall_s: float = 0.0
    stopped: bool = False  # ended early by stop_after_misses
    kv_tiers: dict = field(default_factory=dict)  # where prompt tokens came from (sim_store.tier_summary)


class _Stopped(Exception):
    pass


class Simulator:
    """`exact_steps`: every decode step its own event, as before runs of decode steps were
    planned at once (sim_runs.DecodeRuns); the two give identical records, this one slower."""

    def __init__(self, cluster: SimCluster, exact_steps: bool = False) -> None:
        self.cluster = cluster
        self.now = 0.0
        self.prefills: list[SimView] = []
        self.decodes: list[SimView] = []
        self._order: list[SimView] = []
        for pool in cluster.pools:
            for i in range(pool.replicas):
                w = EngineSim(f"{pool.name}-{i}", pool.role, pool.latency, pool.limits, self._on_sampled)
                wv = RouterView(w.name, pool.name, pool.role, load=SimLoad(w))
                v = SimView(w, wv, local_threshold=pool.local_prefill_threshold, reserve=pool.reserve_pages)
                (self.prefills if pool.role == "prefill" else self.decodes).append(v)
                self._order.append(v)
        for v in self._order:
            v.worker.load_per_stream = cluster.load_same
            v.worker.load_base = cluster.load_base
            v.worker.fast = not (exact_steps or cluster.exact_steps)
            v.worker.clock = self._clock
            v.worker.on_step = self._on_step
        other_prefill = cluster.load_other if cluster.load_other_prefill is None else cluster.load_other_prefill
        if cluster.host_interference or cluster.load_other or other_prefill:
            by_host: dict[str, list[EngineSim]] = {}
            for pool, v in zip((p for p in cluster.pools for _ in range(p.replicas)), self._order):
                if pool.host:
                    by_host.setdefault(pool.host, []).append(v.worker)
            for workers in by_host.values():
                for w in workers:
                    others = [o for o in workers if o is not w]
                    # what the calibration measures: a neighbour's prefill slows this worker's
                    # steps (host_interference, from a controlled measurement), and so, under a
                    # staggered load, do the streams a neighbour decodes (per stream, fitted on a
                    # synthetic load run: load_run.fit_load): load_other on a decode step,
                    # load_other_prefill on a step that prefills. A fixed 1.3x on prefills next to
                    # any decoding neighbour overshot the validation runs' TTFT p90 by 8-14 points
                    # (docs/capacity-planning.md)
                    w.slowdown = lambda prefills, span, others=others: 1.0 + sum(
                        cluster.host_interference * o.prefilling
                        + (other_prefill if prefills else cluster.load_other) * o.decoding_over(span)
                        for o in others)
        self._view = {v.worker: v for v in self.prefills + self.decodes}
        self._by_name = {v.worker.name: v for v in self.prefills + self.decodes}
        self._policy = make_policy(cluster.policy, cluster.hash_page_size)
        self._by_router = {id(v.router): v for v in self._order}
        self._index_capacity = {id(v.router): max(v.worker.limits.num_pages, 1024) for v in self._order}
        self._events: list = []
        self._seq = itertools.count()
        self._inflight = 0
        self._queue: deque[SimRequest] = deque()
        # the KV store tier and prefix fetches (sim_store.py); None: neither is configured
        pools = (p for p in cluster.pools for _ in range(p.replicas))
        tier = KVTier(cluster, list(zip(pools, self._order)), self._push)
        self._tier = tier if tier.enabled else None
        self._fetch: KVTier | None = None

    # ---- the event loop ---------------------------------------------------------------------
    def _clock(self) -> float:
        return self.now

    def _on_step(self, worker: EngineSim, end: float) -> None:
        """A worker's run of decode steps was cut short: its step in flight ends at `end` (unless
        the run is cut again before: the event names the step)."""
        self._push(end, 5, (self._view[worker], worker.step))

    def run(self, workload: Workload, max_concurrency: int | None = None,
            stop_after_misses: tuple[dict[str, float], int] | None = None) -> SimResult:
        """`stop_after_misses` = (slo, n): stop as soon as more than n requests have ended
        without meeting every SLO (the planner's verdict on this run is then known: its
        attainment is below what it needs); requests left unfinished get the error STOPPED and
        the result's `stopped` is True."""
        import time

        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        t_wall = time.perf_counter()
        reqs = to_sim_requests(workload, self.cluster.hash_page_size)
        shared = any(r.block_keys for r in reqs)
        for v in self._order:
            v.worker.prefix_caching(shared)
        if self._tier is not None:
            self._tier.start(shared)
        self._fetch = self._tier if self._tier is not None and self._tier.active else None
        self._timeline = Timeline()
        self._state = {"in_flight": 0, "waiting": 0}
        self._client_cap = max_concurrency
        self._client_queue: deque[SimRequest] = deque()
        self._stop = stop_after_misses
        self._misses = 0
        stopped = False
        # Arrivals are merged in from a sorted list rather than pushed onto the heap, which then
        # holds only the few events in flight (steps, transfers, kicks): at equal times an
        # arrival goes first, as it would with every arrival pushed before any other event.
        arrivals = sorted(reqs, key=lambda r: r.arrival)
        n_arrivals, next_arrival = len(arrivals), 0
        events = self._events
        self._next_arrival = arrivals[0].arrival if arrivals else math.inf
        try:
            self._loop(events, arrivals, n_arrivals, next_arrival)
        except _Stopped:
            stopped = True
            for r in reqs:
                if r.finished < 0:
                    r.error = r.error or "STOPPED"
        end = max([r.finished for r in reqs] + [r.arrival for r in reqs] + [0.0])
        records = [self._record(r) for r in reqs]
        workers = {v.worker.name: _worker_stats(v.worker, end) for v in self.prefills + self.decodes}
        return SimResult(records, max(end, 1e-9), self._timeline, workers, time.perf_counter() - t_wall, stopped,
                         tier_summary(reqs, self._tier))

    def _loop(self, events: list, arrivals: list, n_arrivals: int, next_arrival: int) -> None:
        pop = heapq.heappop
        while events or next_arrival < n_arrivals:
            if next_arrival < n_arrivals and (not events or arrivals[next_arrival].arrival <= events[0][0]):
                req = arrivals[next_arrival]
                next_arrival += 1
                self._next_arrival = arrivals[next_arrival].arrival if next_arrival < n_arrivals else math.inf
                now = self.now = req.arrival
                self._arrive(req, now)
                continue
            now, _, kind, obj = pop(events)
            self.now = now
            if kind == 1:
                self._step_done(obj, now)
            elif kind == 5:  # the end of a run of decode steps, unless it was cut short
                if obj[0].worker.step is obj[1]:
                    self._step_done(obj[0], now)
            elif kind == 2:
                self._kv_done(obj, now)
            elif kind == 6:  # a prefix fetch's pages arrived (sim_store.py)
                self._fetch.arrived(obj[0].worker, obj[1])
                self._kick(obj[0], now)
            elif kind == 4:
                if obj.worker.run is not None:  # (a run: its step in flight is the next step boundary)
                    obj.worker.end_run()
                if not obj.worker.busy:
                    self._admit_queued_pages(obj, now)
            else:
                self._start_step(obj, now)

    def _push(self, t: float, kind: int, obj) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, obj))

    def _note(self, now: float, key: str, delta: int) -> None:
        self._state[key] += delta
        self._timeline.samples.append((now, self._state["in_flight"], self._state["waiting"]))

    def _kick(self, view: SimView, now: float) -> None:
        """Start the worker's next step once every event of this instant is in (requests that
        arrive together are batched together, as the engine loop would find them)."""
        if not view.kick_pending and not view.worker.busy:
            view.kick_pending = True
            self._push(now, 3, view)

    def _start_step(self, view: SimView, now: float) -> None:
        view.kick_pending = False
        w = view.worker
        end = w.start_step(now)
        if end is not None:
            if w.run is not None:
                self._push(end, 5, (view, w.step))
            else:
                self._push(end, 1, view)

    # ---- router: admission and placement ------------------------------------------------------
    def _arrive(self, req: SimRequest, now: float) -> None:
        if self._client_cap is not None and self._state["in_flight"] >= self._client_cap:
            self._client_queue.append(req)
            self._note(now, "waiting", +1)
            return
        self._note(now, "in_flight", +1)
        req.arrival = now  # the send time (later than scheduled when it waited for the client cap)
        if self._inflight < self.cluster.max_inflight:
            self._admit(req, now)
        elif len(self._queue) < self.cluster.max_queue:
            self._queue.append(req)
        else:
            req.error = "RESOURCE_EXHAUSTED"
            self._close(req, now)

    def _admit(self, req: SimRequest, now: float) -> None:
        self._inflight += 1
        req.admitted = now
        dview = self._pick(self.decodes, req, self._policy.place)
        dview.router.inflight += 1
        dview.router.placed += 1
        dec = dview.worker
        req.decode_worker = dec.name
        if dec.role == "colocated" or (dview.local_threshold and
                                       req.prompt_len - dec.cached_prefix_tokens(req) < dview.local_threshold):
            req.local_prefill = True
            if dec.role == "colocated":  # as the router: its prompt counts as queued there until sampled
                dview.router.inflight_tokens += req.prompt_len
                dview.router.remember(req.page_keys, self._index_capacity[id(dview.router)])
            req.prefill_start = now
            dec.add(req)
            self._kick(dview, now)
            return
        if dec.busy or dec.has_work:  # it takes calls between steps, slower while it steps
            dview.admit_queue.append((now + self.cluster.busy_admit_s, req))
            self._push(now + self.cluster.busy_admit_s, 4, dview)
        elif not dview.page_queue and self._reserve(dview, req):
            self._dispatch_prefill(req, now)
        else:
            dview.page_queue.append(req)

    def _reserve(self, dview: SimView, req: SimRequest) -> bool:
        if not dview.worker.reserve(req, dview.reserve):
            return False
        req.dest_pages = dview.worker.limits.pages_for(req.prompt_len)
        return True

    def _admit_queued_pages(self, dview: SimView, now: float) -> None:
        while dview.page_queue and self._reserve(dview, dview.page_queue[0]):
            self._dispatch_prefill(dview.page_queue.popleft(), now)
        while dview.admit_queue and dview.admit_queue[0][0] <= now:
            req = dview.admit_queue.popleft()[1]
            if not dview.page_queue and self._reserve(dview, req):
                self._dispatch_prefill(req, now)
            else:
                dview.page_queue.append(req)

    def _dispatch_prefill(self, req: SimRequest, now: float) -> None:
        pview = self._pick(self.prefills, req, self._policy.pick_prefill)
        pview.router.inflight += 1
        pview.router.placed += 1
        pview.router.inflight_tokens += req.prompt_len
        req.prefill_worker = pview.worker.name
        req.prefill_start = now
        if self._fetch is None or not self._fetch.place(pview, req, now):
            pview.worker.add(req)
        self._kick(pview, now)

    def _pick(self, views: list[SimView], req: SimRequest, pick) -> SimView:
        return self._by_router[id(pick([v.router for v in views], req.page_keys))]

    # ---- workers --------------------------------------------------------------------------------
    def _on_sampled(self, worker: EngineSim, req: SimRequest, now: float) -> None:
        if req.first_token < 0:  # sampled here from the prompt: the first token
            req.first_token = now
            if worker.role == "colocated":
                self._view[worker].router.inflight_tokens -= req.prompt_len
        if worker.role == "prefill":  # its pages stay held until the transfer ends
            view = self._view[worker]
            view.router.inflight -= 1
            view.router.inflight_tokens -= req.prompt_len
            view.router.remember(req.page_keys, self._index_capacity[id(view.router)])
            self._start_transfer(view, req, now)
        elif req.generated >= req.output_len:  # the engine freed its pages
            self._finish(req, now)

    def _start_transfer(self, pview: SimView, req: SimRequest, now: float) -> None:
        lm = pview.worker.latency
        dest = self._by_name[req.decode_worker].worker
        req.kv_bytes = req.dest_pages * dest.limits.page_size * lm.kv_bytes_per_token
        total = lm.transfer_time(req.kv_bytes, self.cluster.transport)
        start = max(pview.link_free, pview.worker.last_step_start)
        end = max(start + total, now + total / max(lm.num_layers, 1))
        pview.link_free = end
        self._push(end + self.cluster.kv_handoff_s, 2, req)

    def _kv_done(self, req: SimRequest, now: float) -> None:
        pview = self._by_name[req.prefill_worker]
        pview.worker.release_held(req)
        self._kick(pview, now)
        req.kv_done = now
        dview = self._by_name[req.decode_worker]
        if req.generated >= req.output_len:  # a one-token answer: nothing to decode
            dview.worker.drop(req)
            self._finish(req, now)
            self._admit_queued_pages(dview, now)
            return
        dview.worker.join(req)
        req.forget_prompt()  # both workers hold their engine copies now
        self._kick(dview, now)

    def _step_done(self, view: SimView, now: float) -> None:
        view.worker.finish_step()
        if view.worker.role != "prefill":
            self._admit_queued_pages(view, now)
        if (not view.kick_pending and not view.worker.busy and self._next_arrival > now
                and (not self._events or self._events[0][0] > now)):
            # nothing else happens at this instant: the kick would be the very next event
            self._start_step(view, now)
        else:
            self._kick(view, now)

    # ---- the end of a request ----------------------------------------------------------------
    def _finish(self, req: SimRequest, now: float) -> None:
        dview = self._by_name[req.decode_worker]
        dview.router.inflight -= 1
        self._inflight -= 1
        if self._fetch is not None:  # its pages go to the node's KV store
            self._fetch.offload(dview.worker, req)
        self._close(req, now)
        if self._queue:
            self._admit(self._queue.popleft(), now)

    def _close(self, req: SimRequest, now: float) -> None:
        req.finished = now
        req.forget_prompt()
        if self._stop is not None and not meets_slo(self._record(req), self._stop[0]):
            self._misses += 1
            if self._misses > self._stop[1]:
                raise _Stopped
        self._note(now, "in_flight", -1)
        if self._client_queue:
            nxt = self._client_queue.popleft()
            self._note(now, "waiting", -1)
            self._arrive(nxt, now)

    def _record(self, r: SimRequest) -> RequestRecord:
        c = self.cluster
        rec = RequestRecord(index=r.index, request_id=f"sim-{r.index}", scheduled_s=r.scheduled, start_s=r.arrival,
                            prompt_len=r.prompt_len, max_tokens=r.output_len)
        if r.error or not r.token_times:
            rec.error = r.error or "NOT_FINISHED"
            return rec
        delay, start = c.first_token_delay_s, r.arrival
        rec.ok = True
        rec.chunk_times_s = [t + delay - start for t in r.token_times]
        rec.ttft_s = rec.chunk_times_s[0]
        rec.e2e_s = rec.chunk_times_s[-1]
        rec.output_tokens = len(r.token_times)
        rec.cached_tokens = max(r.cached, 0)
        rec.server = {"queue_s": r.admitted - r.arrival, "prefill_s": r.first_token - r.prefill_start,
                      "transfer_s": (r.kv_done - r.first_token) if r.kv_done >= 0 else 0.0,
                      "prefill_worker": r.prefill_worker or r.decode_worker, "decode_worker": r.decode_worker,
                      "local_prefill": r.local_prefill, "preemptions": r.preemptions,
                      "kv_bytes": r.kv_bytes}
        if r.fetched:
            rec.server.update(fetched_tokens=r.fetched, fetched_from=r.fetch_from)
        return rec


def _worker_stats(w: EngineSim, end: float) -> dict:
    return {"role": w.role, "busy_fraction": w.busy_s / end if end > 0 else 0.0, "steps": w.steps,
            "mean_batched_tokens": w.batched_tokens / w.steps if w.steps else 0.0,
            "mean_decode_batch": w.decode_seqs / w.steps if w.steps else 0.0, "preemptions": w.preemptions,
            "cached_prompt_tokens": w.cached_tokens, "computed_prompt_tokens": w.computed_prompt_tokens}


def simulate(cluster: SimCluster, workload: Workload, max_concurrency: int | None = None,
             exact_steps: bool = False, stop_after_misses: tuple[dict[str, float], int] | None = None) -> SimResult:
    return Simulator(cluster, exact_steps).run(workload, max_concurrency, stop_after_misses)
