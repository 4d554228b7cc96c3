"""One simulated worker: the engine's own scheduler, with step times instead of tensors.

`EngineSim` runs `engine.scheduler.Scheduler` over an `engine.kv_cache_manager.KVCacheManager`,
exactly the objects a served worker runs, and replaces only the model: a step takes the time
the pool's `LatencyModel` gives for the batch the scheduler built (the timing-only runner). So
continuous batching, chunked prefill, the page budget, preemption by recompute, the prefix
cache (with its LRU eviction), remote-KV joins and pages held for a transfer behave in the
simulation as they do when serving, and a scheduler change reaches both at once.

Each simulated request (`SimRequest`, sim_request.py: the cluster-wide record of arrival,
placement, token times) becomes an engine `Request` on every worker that holds it, with
synthetic token ids. A prefill worker's requests run to their first token and carry a
destination, so the scheduler holds their pages after they finish until the simulator's
transfer ends (`release_held`), through the engine's own KV connector contract
(`_TransferHold`). Runs of decode steps planned at once (sim_runs.py) make it faster, never
different.

The step time is the pool's `LatencyModel.step_time` for the batch's prefill chunks (new tokens,
cached or computed prefix) and decode count and context, times `1 + load_base` for a step that
only decodes and `1 + load_per_stream` per decoding sequence past the first (what a served
worker pays under staggered load beyond its calibrated step), times `slowdown(prefills, span)`:
neighbours on the same host's cores prefilling or decoding slow this worker down, a neighbour's
streams counting for the share of the step they are expected to go on decoding
(`decoding_over`). What the owner does when a request samples its first or last token here is
the `on_sampled` callback's business.
"""
from __future__ import annotations

from collections.abc import Callable

from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnector, KVEvent
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from planning.latency import LatencyModel
from planning.sim_request import EngineLimits, SimRequest
from planning.sim_runs import MAX_RUN, DecodeRuns, _Run, _Step

__all__ = ["EngineLimits", "EngineSim", "SimRequest"]

_SENT = ("sim",)     # a prefill request's destination: the simulator moves its KV


class _TransferHold(KVConnector):
    """The scheduler side of a connector that moves nothing: a request with a destination keeps
    its pages after it finishes, until the simulator says its transfer ended."""

    def register_kv_caches(self, kv_caches: list) -> None:
        pass

    def check(self, req: Request) -> None:
        pass

    def start_save(self, req: Request) -> str | None:
        return None

    def prepare_receive(self, req: Request) -> object:
        return None

    def request_finished(self, req: Request) -> bool:
        return bool(req.kv_destinations) and req.status != RequestStatus.FINISHED_ABORTED

    def cancel(self, req: Request) -> None:
        pass

    def prepare_fetch(self, req: Request, pages: list[int], num_tokens: int) -> object:
        return None  # a prefix fetch (sim_store.py): the simulator times it, nothing moves

    def save_layer(self, layer: int) -> None:
        pass

    def finish_save(self, req: Request, first_token: int) -> str | None:
        return None

    def take_events(self) -> list[KVEvent]:
        return []

    @property
    def has_events(self) -> bool:
        return False

    def set_wakeup(self, fn: Callable[[], None]) -> None:
        pass

    def close(self) -> None:
        pass


class EngineSim(DecodeRuns):
    """A worker's engine. `on_sampled(worker, request, now)` is called when a request samples
    its first token here (from its prompt) or its last (`output_len` reached), after the step's
    bookkeeping. Tokens in between only append to `token_times`: a simulated hour samples
    millions of them, and the owner has nothing to do for those."""

    def __init__(self, name: str, role: str, latency: LatencyModel, limits: EngineLimits,
                 on_sampled: Callable[[EngineSim, SimRequest, float], None]) -> None:
        self.name, self.role, self.latency, self.limits = name, role, latency, limits
        self.on_sampled = on_sampled
        self._requests: dict[str, SimRequest] = {}  # engine request id -> the simulated request
        self._engine: dict[int, Request] = {}        # simulated request index -> its engine request here
        self.prefix_caching(True)
        # x step time from neighbours busy on the same host, given whether the step prefills and
        # how long it would take (set by the owner; None = alone)
        self.slowdown: Callable[[bool, float], float] | None = None
        # x (1 + this per decoding sequence past the first): what a served worker's steps pay
        # under a staggered load beyond the calibrated step (load_run.fit_load)
        self.load_per_stream = 0.0
        # x (1 + this) on a step that only decodes: what a lone stream pays under that load
        self.load_base = 0.0
        self.step: _Step | None = None
        # Runs of decode steps (sim_runs.DecodeRuns): on unless the owner asks for the exact step-by-step
        # path. `clock()` is the owner's simulated time (what a run's state is read at).
        self.fast = True
        self.clock: Callable[[], float] = lambda: 0.0
        self.run: _Run | None = None
        self._run_skip = 0     # ordinary steps to take before planning a run again (speed only)
        self._run_len = 16     # steps to plan next: twice what the last run lasted (speed only)
        self._run_backoff = 0
        self.trace: list | None = None  # set to a list to record every step: (start, ((request id, new tokens), ...))
        self.on_step: Callable[[EngineSim, float], None] = lambda worker, end: None  # a run cut short: its step in flight ends then
        self.last_step_start = 0.0
        self.last_step_s = 0.0
        self.finishing = False
        # statistics
        self.busy_s = 0.0
        self.steps = 0
        self.batched_tokens = 0
        self.decode_seqs = 0
        self.cached_tokens = 0

    def prefix_caching(self, enabled: bool) -> None:
        """A fresh engine, with or without the prefix cache. The owner turns it off for a
        workload without shared prefix blocks: no page can ever hit, so the cache changes no
        decision, and hashing every page of an hour's prompts is most of a simulation's time."""
        # the synthetic page hashes name page contents exactly (SimRequest.page_hashes): the pool
        # need keep no copy of each page's tokens to check a hit against
        self.kv = KVCacheManager(self.limits.num_pages, self.limits.page_size, enable_prefix_caching=enabled,
                                 verify_tokens=False)
        self.scheduler = Scheduler(self.kv, self.limits.max_num_batched_tokens, self.limits.max_num_seqs,
                                   _TransferHold())
        self._requests.clear()
        self._engine.clear()

    # ---- what the owner reads ---------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.step is not None

    @property
    def free_pages(self) -> int:
        run = self.run
        if run is None:
            return self.kv.num_free_pages
        # a planned run's pages as the step-by-step path would have them now: every page taken
        # by the steps started so far (pages are taken when a step is scheduled, none given back)
        return self.kv.num_free_pages - run.allocs(run.started(self.clock()) - 1)

    @property
    def preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def computed_prompt_tokens(self) -> int:
        return self.scheduler.num_computed_prompt_tokens

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished

    # What slows a neighbour down, asked when the neighbour starts a step: this worker's step in
    # flight or, between two of its steps (an instant: a worker with work starts the next one
    # then), the step it is about to start. A disaggregated prefill is dispatched at the end of a
    # decode step (the decode worker takes calls between steps), so asking only for the step in
    # flight would never see the streams that decode beside it.
    @property
    def prefilling(self) -> bool:
        if self.step is not None:
            return self.step.prefills
        sched = self.scheduler
        return bool(sched.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)

    @property
    def decoding(self) -> int:
        if self.step is not None:
            return self.step.decodes
        sched = self.scheduler
        return sum(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running) + len(sched.ready)

    def decoding_over(self, span: float) -> float:
        """Streams decoding here, averaged over the next `span` seconds: each counts for the share
        of the span its remaining tokens last at this worker's latest step time (the load fit reads
        streams the same way, time-averaged over a prompt's TTFT: load_run.request_samples). A
        neighbour's long prefill step would otherwise pay for a stream that ends a few steps into
        it as if it decoded throughout. Streams that will join later are not foreseen."""
        n = self.decoding
        step_s = self.last_step_s
        if not n or span <= 0 or step_s <= 0:
            return float(n)
        counted = 0.0
        for r in self.scheduler.running:
            if r.num_computed_tokens >= r.num_prompt_tokens:
                left = r.params.max_tokens - r.num_output_tokens
                counted += min(1.0, max(left, 0) * step_s / span)
        return min(counted + len(self.scheduler.ready), float(n))

    def cached_prefix_tokens(self, req: SimRequest) -> int:
        """Prompt tokens a new request would take from this worker's prefix cache now."""
        if not req.block_keys:
            return 0
        self.sync()
        return len(self.kv.find_cached_prefix(self._engine_request(req))) * self.limits.page_size

    # ---- what the owner does ----------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        """Queue a request whose prompt is computed here (a prefill worker's runs to its first
        token and then holds its pages until `release_held`)."""
        self.end_run()
        self.scheduler.add(self._engine_request(req))

    def reserve(self, req: SimRequest, reserve_pages: int = 0) -> bool:
        """Allocate the pages a request's transferred prompt will fill (keeping `reserve_pages`
        free); False, with nothing kept, when they are short."""
        self.sync()
        if self.kv.num_free_pages - self.limits.pages_for(req.prompt_len) < reserve_pages:
            return False
        eng = self._engine_request(req)
        if not self.kv.allocate(eng, req.prompt_len):
            self._forget(eng)
            return False
        self.scheduler.add_remote(eng)
        return True

    def join(self, req: SimRequest) -> None:
        """The reserved request's KV arrived, with its first token sampled elsewhere: it joins
        the batch at the next step with a free sequence slot."""
        self.end_run()
        self.scheduler.kv_received(self._engine[req.index], 0)

    def drop(self, req: SimRequest) -> None:
        """End a request here (its pages come back), e.g. a one-token answer whose KV arrived."""
        self.sync()
        eng = self._engine.get(req.index)
        if eng is not None:
            self.scheduler.abort(eng)
            self._forget(eng)

    def release_held(self, req: SimRequest) -> None:
        """A finished prefill request's transfer ended: its pages come back."""
        self.sync()
        eng = self._engine.get(req.index)
        if eng is not None and self.scheduler.release(eng):
            self._forget(eng)

    # ---- one step ---------------------------------------------------------------------------
    def _duration(self, chunks: list, num_dec: int, ctx: int) -> float:
        """A step's time before neighbours' slowdown (the one formula both paths use)."""
        dur = self.latency.step_time(chunks, num_dec, ctx)
        if self.load_per_stream and num_dec > 1:
            dur *= 1.0 + self.load_per_stream * (num_dec - 1)
        if self.load_base and num_dec and not chunks:
            dur *= 1.0 + self.load_base
        return dur

    def start_step(self, now: float) -> float | None:
        """Schedule a step if there is work and none is running; returns its end time (with
        `fast` on, the end of a run of decode steps planned at once: DecodeRuns._plan_run)."""
        if self.finishing or self.step is not None or not self.scheduler.has_unfinished:
            return None  # (finishing: called back from inside finish_step; its owner starts the next)
        batch = None
        if self.fast and self.slowdown is None:
            if self._run_skip:  # recent runs were cut at once (a join or an admission every step)
                self._run_skip -= 1
            else:
                end, batch = self._plan_run(now)
                if end is not None:
                    return end
        if batch is None:
            batch = self.scheduler.schedule()
        for eng in batch.preempted:
            self._requests[eng.request_id].preemptions += 1
        if batch.empty:
            return None
        chunks: list[tuple[int, int]] = []
        num_dec = ctx = 0
        for eng, n in zip(batch.requests, batch.num_new_tokens):
            computed = eng.num_computed_tokens
            if n == 1 and computed >= eng.num_prompt_tokens:
                num_dec += 1
                ctx += computed + 1
            else:
                chunks.append((n, computed))
        dur = self._duration(chunks, num_dec, ctx)
        if self.slowdown is not None:
            # the factor depends on the step's length (how much of it a neighbour's streams
            # overlap); one refinement on the slowed length is enough
            f = self.slowdown(bool(chunks), dur)
            if f != 1.0:  # nothing busy next door: the factor does not depend on the length
                f = self.slowdown(bool(chunks), dur * f)
            dur *= f
        self.last_step_s = dur
        if self.trace is not None:
            self.trace.append((now, tuple((e.request_id, n) for e, n in zip(batch.requests, batch.num_new_tokens))))
        self.step = _Step(now, now + dur, batch, bool(chunks), num_dec)
        self.steps += 1
        self.busy_s += dur
        self.batched_tokens += batch.num_tokens
        self.decode_seqs += num_dec
        return now + dur

    def finish_step(self) -> float:
        """Apply the running step's effects; returns its end time."""
        if self.run is not None:
            return self._finish_run()
        return self._finish_ordinary()

    def _finish_ordinary(self) -> float:
        step, self.step = self.step, None
        self.last_step_start = step.start
        now = step.end
        self.finishing = True
        try:
            self._apply(step.batch, now)
        finally:
            self.finishing = False
        return now

    def _apply(self, batch: ScheduledBatch, now: float) -> None:
        sampled = {eng: (0, None) for eng, n in zip(batch.requests, batch.num_new_tokens)
                   if eng.num_computed_tokens + n >= len(eng.all_token_ids)}
        for eng in self.scheduler.update(batch, sampled):
            req = self._requests[eng.request_id]
            generated = req.generated = req.generated + 1
            req.token_times.append(now)
            if req.cached < 0:
                req.cached = max(eng.num_cached_tokens, 0)
                self.cached_tokens += req.cached
            if eng.status.finished and eng.request_id not in self.scheduler.held:
                self._forget(eng)
            if generated == 1 or generated >= req.output_len:
                self.on_sampled(self, req, now)

    # ---- runs of decode steps ------------------------------------------------------------------
    def sync(self) -> None:
        """Something reaches this worker now, inside a run: apply the steps done by now and turn
        the one running into an ordinary step (`on_step` is told its end); the run ends there.
        A run cut in its first steps makes the next runs wait (planning one costs about a step;
        where something arrives every step, none would last): which steps go in runs changes
        only the speed, never a result."""
        run = self.run
        if run is not None:
            j = run.started(self.clock()) - 1
            self._adapt(j)
            self._apply_run(j, True)

    def end_run(self) -> None:
        """Something reaches this worker now that only changes its next batch (a request to
        admit or one whose KV arrived): a run ends with its step in flight (`on_step` is told
        its end), where the step-by-step path would next call the scheduler. Nothing is applied
        yet: the run's steps are applied together when it ends."""
        run = self.run
        if run is not None:
            k = run.started(self.clock())
            self._adapt(k - 1)
            if k < len(run.ends):
                del run.ends[k:]
                del run.durs[k:]
                run.last_ordinary = False
                self.step = _Step(run.start, run.ends[-1], None, False, len(run.reqs))
                self.on_step(self, run.ends[-1])

    def _adapt(self, j: int) -> None:
        """Plan the next run from how many steps this one ran before something reached it."""
        if j < 2:
            self._run_backoff = min(2 * self._run_backoff + 1, 32)
            self._run_skip = self._run_backoff
        else:
            self._run_backoff = 0
        self._run_len = max(8, 2 * (j + 1))

    def _finish_run(self) -> float:
        run = self.run
        self._run_backoff = 0
        self._run_len = min(MAX_RUN, 2 * len(run.ends))
        if run.last_ordinary:  # its last step samples a last token: the ordinary way, now
            self._apply_run(len(run.ends) - 1, True, notify=False)
            return self._finish_ordinary()
        self._apply_run(len(run.ends), False)
        return run.ends[-1]

    # ---- engine requests --------------------------------------------------------------------
    def engine_request(self, req: SimRequest) -> Request:
        """This worker's engine request of `req` (made on first use)."""
        return self._engine_request(req)

    def _engine_request(self, req: SimRequest) -> Request:
        eng = self._engine.get(req.index)
        if eng is None:
            prefill = self.role == "prefill"
            params = SamplingParams(temperature=0.0, max_tokens=1 if prefill else req.output_len, ignore_eos=True)
            eng = Request(request_id=str(req.index), prompt_token_ids=req.token_ids(), params=params,
                          max_total_tokens=req.prompt_len + params.max_tokens,
                          kv_destinations=_SENT if prefill else ())
            if self.kv.pool.enable_prefix_caching:
                eng.block_hashes = list(req.page_hashes(self.limits.page_size))
            self._engine[req.index] = eng
            self._requests[eng.request_id] = req
        return eng

    def _forget(self, eng: Request) -> None:
        self._engine.pop(int(eng.request_id), None)
        self._requests.pop(eng.request_id, None)
