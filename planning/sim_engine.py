"""One simulated worker: the engine's continuous batching, in step times instead of tensors.

`EngineSim` follows `engine.scheduler.Scheduler` rule for rule, so the simulator sees the same
batches the real worker builds: each step has a token budget; running requests go first, in
arrival order (a decoding request takes one token, one still prefilling takes a chunk of what
is left); then waiting requests are admitted oldest first while budget, sequence slots and
pages last, each first taking its longest cached prefix. A running request that needs a page
when none is free preempts the most recently arrived running request, which goes back to the
front of the queue and is recomputed from all its tokens (prompt and output so far).

A request's tokens: `num_tokens` (prompt plus sampled output) and `computed` (tokens whose KV
is in this worker's pages). A step runs `num_tokens - computed` (or a chunk of it); when a
request's `computed` reaches `num_tokens` a token is sampled. That one rule covers a prefill
(its first token), a decode step, a recompute after preemption, and a request that arrives
with its prompt KV already transferred (`join`).

Prefix cache: Mooncake-style block ids (`SimRequest.block_keys`, each the chained key of a
prompt's first k blocks) are what can be shared; the cache is an LRU of block keys, each
costing the pages it covers, plus one entry for each request's unshared pages, capped at the
pages not held by running requests. Pages a request reuses still count against the pool
(as in the engine, a hit saves compute, not memory).

The step time is the pool's `LatencyModel.step_time`, times `1 + load_base` for a step that only
decodes and `1 + load_per_stream` per decoding sequence past the first (what a served worker pays
under staggered load beyond its calibrated step), times `slowdown(prefills, span)` (neighbours on
the same host's cores prefilling or decoding slow this worker down, a step that prefills by its
own factor; a neighbour's streams count for the share of the step they are expected to go on
decoding, `decoding_over`). What the worker does with
a request that reached its first token or finished is its owner's business (`on_sampled`).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from planning.latency import LatencyModel


@dataclass(slots=True, eq=False)
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    block_keys: tuple = ()       # chained keys of the shared prefix blocks, in order
    block_tokens: int = 0        # tokens per shared block
    # progress on the worker that holds it now
    num_tokens: int = 0
    computed: int = 0
    pages: int = 0
    generated: int = 0
    cached: int = -1             # prompt tokens served by the prefix cache (first admission)
    # where and when (absolute simulated seconds)
    token_times: list = field(default_factory=list)
    admitted: float = -1.0
    prefill_start: float = -1.0
    first_token: float = -1.0
    kv_done: float = -1.0
    finished: float = -1.0
    prefill_worker: str = ""
    decode_worker: str = ""
    local_prefill: bool = False
    error: str = ""
    preemptions: int = 0
    scheduled: float = 0.0       # the workload's arrival (the send may wait for a client slot)
    dest_pages: int = 0          # pages reserved on the decode worker while the prefill runs
    kv_bytes: int = 0
    page_keys: tuple = ()        # the router's hashes of its shared full pages (prefix-aware placement)

    def __post_init__(self) -> None:
        self.num_tokens = self.prompt_len


@dataclass(slots=True)
class EngineLimits:
    page_size: int = 16
    num_pages: int = 4096
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


class PrefixLRU:
    """Block keys (and per-request private entries) -> pages they cover, least recent first."""

    __slots__ = ("entries", "pages")

    def __init__(self) -> None:
        self.entries: OrderedDict = OrderedDict()
        self.pages = 0

    def match(self, keys: tuple) -> int:
        """How many leading keys are cached; touches them."""
        n = 0
        for k in keys:
            if k not in self.entries:
                break
            self.entries.move_to_end(k)
            n += 1
        return n

    def insert(self, key, pages: int, capacity: int) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        self.entries[key] = pages
        self.pages += pages
        self.shrink(capacity)

    def shrink(self, capacity: int) -> None:
        while self.pages > max(capacity, 0) and self.entries:
            _, p = self.entries.popitem(last=False)
            self.pages -= p


@dataclass(slots=True)
class _Step:
    start: float
    end: float
    scheduled: list  # (request, new tokens)
    prefills: bool = False  # any prompt tokens in it (what slows a neighbour down)
    decodes: int = 0        # sequences decoding in it (what slows a neighbour down under load)


class EngineSim:
    """A worker's engine. `on_sampled(worker, request, now)` is called when a request samples
    its first token here (from its prompt) or its last (`output_len` reached), after the step's
    bookkeeping; it returns True to keep the request running (decode on), False when the owner
    took it out (finished, or handed off). Tokens in between only append to `token_times`: a
    simulated hour samples millions of them, and the owner has nothing to do for those."""

    def __init__(self, name: str, role: str, latency: LatencyModel, limits: EngineLimits,
                 on_sampled: Callable[[EngineSim, SimRequest, float], bool]) -> None:
        self.name, self.role, self.latency, self.limits = name, role, latency, limits
        self.on_sampled = on_sampled
        # x step time from neighbours busy on the same host, given whether the step prefills and
        # how long it would take (set by the owner; None = alone)
        self.slowdown: Callable[[bool, float], float] | None = None
        # x (1 + this per decoding sequence past the first): what a served worker's steps pay
        # under a staggered load beyond the calibrated step (load_run.fit_load)
        self.load_per_stream = 0.0
        # x (1 + this) on a step that only decodes: what a lone stream pays under that load
        self.load_base = 0.0
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.arrived: deque[SimRequest] = deque()  # KV here, waiting for a sequence slot
        self.free_pages = limits.num_pages
        self.cache = PrefixLRU()
        self.step: _Step | None = None
        self.last_step_start = 0.0
        self.last_step_s = 0.0
        self.finishing = False
        # statistics
        self.busy_s = 0.0
        self.steps = 0
        self.batched_tokens = 0
        self.decode_seqs = 0
        self.preemptions = 0
        self.cached_tokens = 0
        self.computed_prompt_tokens = 0

    # ---- what the owner calls ---------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.step is not None

    # What slows a neighbour down, asked when the neighbour starts a step: this worker's step in
    # flight or, between two of its steps (an instant: a worker with work starts the next one
    # then), the step it is about to start. A disaggregated prefill is dispatched at the end of a
    # decode step (the decode worker takes calls between steps), so asking only for the step in
    # flight never saw the streams that decode beside it.
    @property
    def prefilling(self) -> bool:
        if self.step is not None:
            return self.step.prefills
        return bool(self.waiting) or any(r.computed < r.prompt_len for r in self.running)

    @property
    def decoding(self) -> int:
        if self.step is not None:
            return self.step.decodes
        return sum(r.computed >= r.prompt_len for r in self.running) + len(self.arrived)

    def decoding_over(self, span: float) -> float:
        """Streams decoding here, averaged over the next `span` seconds: each counts for the share
        of the span its remaining tokens last at this worker's latest step time. A neighbour's
        long prefill step (hundreds of ms) used to pay for a stream that finished a few steps
        into it as if it decoded throughout (the twentieth validation run: a 1,110-token prompt
        arriving 40 ms before a neighbour's stream ended predicted at 200-235 ms, measured
        145-203); the load fit reads streams the same way, time-averaged over the prompt's TTFT
        (load_run.request_samples). Streams that will join later are not foreseen."""
        n = self.decoding
        if not n or span <= 0:
            return float(n)
        step_s = self.last_step_s
        if step_s <= 0:
            return float(n)
        counted = 0.0
        for r in self.running:
            if r.computed >= r.prompt_len:
                counted += min(1.0, max(r.output_len - r.generated, 0) * step_s / span)
        return min(counted + len(self.arrived), float(n))

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.arrived)

    def add(self, req: SimRequest) -> None:
        """Queue a request whose prompt must be computed here."""
        self.waiting.append(req)

    def join(self, req: SimRequest) -> None:
        """A request whose prompt KV arrived in pages already allocated here, with its first
        token sampled elsewhere: it joins the batch at the next step with a free sequence slot."""
        req.computed = req.prompt_len
        req.num_tokens = req.prompt_len + req.generated
        self.arrived.append(req)

    def try_reserve(self, pages: int, reserve: int = 0) -> bool:
        if self.free_pages - pages < reserve:
            return False
        self.free_pages -= pages
        self.cache.shrink(self.free_pages)
        return True

    def release(self, req: SimRequest) -> None:
        """Give back a request's pages; its full prompt pages stay findable in the cache."""
        self.free_pages += req.pages
        req.pages = 0

    def remember_prompt(self, req: SimRequest) -> None:
        """The request's prompt pages are now in this worker's prefix cache (LRU)."""
        ps = self.limits.page_size
        cap = self.free_pages + req.pages  # pages not held by other requests
        shared_pages = 0
        if req.block_keys:
            per_block = max(req.block_tokens // ps, 0)
            for k in req.block_keys:
                self.cache.insert(k, per_block, cap)
            shared_pages = per_block * len(req.block_keys)
        private = self.limits.pages_for(req.prompt_len) - shared_pages
        if private > 0:
            self.cache.insert(("req", req.index), private, cap)

    def cached_prefix_tokens(self, req: SimRequest) -> int:
        """Tokens of the prompt a new request would take from the cache (full pages, and at
        least one prompt token left to compute, as the engine does)."""
        if not req.block_keys:
            return 0
        blocks = self.cache.match(req.block_keys)
        ps = self.limits.page_size
        tokens = (blocks * req.block_tokens) // ps * ps
        return min(tokens, (req.prompt_len - 1) // ps * ps)

    # ---- one step ---------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Schedule a step if there is work and none is running; returns its end time."""
        lim = self.limits
        if self.finishing:
            return None  # called back from inside finish_step: its owner starts the next step after
        while self.arrived and len(self.running) < lim.max_num_seqs:
            self.running.append(self.arrived.popleft())
        if self.step is not None or not (self.running or self.waiting):
            return None
        ps = lim.page_size
        budget = lim.max_num_batched_tokens
        chosen: list = []
        chunks: list = []
        add = chosen.append
        num_dec = ctx = 0
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.computed
            n = req.num_tokens - computed
            if n > budget:
                n = budget
            end = computed + n
            if end > req.pages * ps:  # the step writes past the pages it holds
                need = -(-end // ps) - req.pages
                lost = False
                while need > self.free_pages:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        lost = True
                        break
                if lost:
                    break  # req itself was preempted: every request after it is gone too
                self.free_pages -= need
                req.pages += need
            add((req, n))
            budget -= n
            if n == 1 and computed >= req.prompt_len:
                num_dec += 1
                ctx += computed + 1
            else:
                chunks.append((n, computed))
            i += 1
        if not preempted:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < lim.max_num_seqs:
                req = waiting[0]
                cached = self.cached_prefix_tokens(req) if req.computed == 0 else 0
                n = req.num_tokens - req.computed - cached
                if n > budget:
                    n = budget
                need = -(-(req.computed + cached + n) // ps) - req.pages
                if need > self.free_pages:
                    break
                waiting.popleft()
                self.free_pages -= need
                req.pages += need
                if req.cached < 0:
                    req.cached = cached
                    self.cached_tokens += cached
                req.computed += cached
                running.append(req)
                chosen.append((req, n))
                budget -= n
                chunks.append((n, req.computed))
        if not chosen:
            return None
        if self.cache.pages > self.free_pages:
            self.cache.shrink(self.free_pages)
        dur = self.latency.step_time(chunks, num_dec, ctx)
        if self.load_per_stream and num_dec > 1:
            dur *= 1.0 + self.load_per_stream * (num_dec - 1)
        if self.load_base and num_dec and not chunks:
            dur *= 1.0 + self.load_base
        if self.slowdown is not None:
            # the factor depends on the step's length (how much of it a neighbour's streams
            # overlap); one refinement on the slowed length is enough
            f = self.slowdown(bool(chunks), dur)
            if f != 1.0:  # nothing busy next door: the factor does not depend on the length
                f = self.slowdown(bool(chunks), dur * f)
            dur *= f
        self.last_step_s = dur
        self.step = _Step(now, now + dur, chosen, bool(chunks), num_dec)
        self.steps += 1
        self.busy_s += dur
        self.batched_tokens += lim.max_num_batched_tokens - budget
        self.decode_seqs += num_dec
        return now + dur

    def finish_step(self) -> float:
        """Apply the running step's effects; returns its end time."""
        step, self.step = self.step, None
        self.last_step_start = step.start
        now = step.end
        self.finishing = True
        try:
            self._apply(step.scheduled, now)
        finally:
            self.finishing = False
        return now

    def _apply(self, scheduled: list, now: float) -> None:
        on_sampled = self.on_sampled
        for req, n in scheduled:
            before = req.computed
            computed = req.computed = before + n
            if before < req.prompt_len:
                self.computed_prompt_tokens += min(computed, req.prompt_len) - before
            if computed < req.num_tokens:
                continue  # a chunk of a longer prefill
            generated = req.generated = req.generated + 1
            req.num_tokens += 1
            req.token_times.append(now)
            if (generated == 1 or generated >= req.output_len) and not on_sampled(self, req, now):
                self.running.remove(req)

    def _preempt(self, req: SimRequest) -> None:
        self.free_pages += req.pages
        req.pages = 0
        req.computed = 0
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)
