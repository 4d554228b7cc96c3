"""Continuous batching with chunked prefill and preemption by recompute, and the scheduler side
of the KV connector (engine/kv_connector.py).

Each step has a token budget (`max_num_batched_tokens`). First, requests whose remote KV has
arrived join the running batch, while sequence slots last. Running requests are served next,
in arrival order: a decoding request takes one token, a request still prefilling takes the
rest of its prompt or whatever budget is left (a chunk). Then waiting requests are admitted,
oldest first, while budget, sequence slots and pages last; a newly admitted request first
takes its longest cached prefix from the prefix cache.

When a running request needs a page and none is free, the most recently arrived running
request is preempted: its pages go back to the pool (full ones stay findable in the prefix
cache) and it returns to the front of the waiting queue, to be recomputed from all its tokens
later. Nothing it generated is lost, and a seeded request draws the same tokens (its draws
are keyed by token position, engine.sampler).

The request states this module moves (engine/request.py draws them all):
  waiting      WAITING / PREEMPTED, no pages (or a cached prefix being taken)
  waiting_kv   WAITING_FOR_REMOTE_KV: pages allocated, the connector fills them; never scheduled (a
               prefix fetch fills only leading pages: the request then goes to `waiting`)
  ready        WAITING_FOR_REMOTE_KV, KV complete: joins `running` at the next step with a free slot
  running      RUNNING
  held         finished, pages still needed by the connector (a send or receive in flight) until
               `release`
A request whose last prompt chunk is scheduled and whose KV goes elsewhere (`kv_destinations`)
starts its send here (`KVConnector.start_save`); a send that cannot start fails the request.

No torch here (nor in request.py, kv_cache_manager.py, block_pool.py): the capacity planner's
simulator runs this scheduler itself, with step times instead of a model.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnector
from engine.request import Request, RequestStatus

_FINISHED = RequestStatus.FINISHED_STOPPED  # statuses from here on are finished


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: (request, number of new tokens), decode-shaped (1 token) first.
    `joined`: requests that joined with a first token sampled elsewhere (their output is due
    even if they finished on it); `saving`: requests whose KV send started this step;
    `failed`: requests that failed while being scheduled (a send that could not start)."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Request] = field(default_factory=list)
    joined: list[Request] = field(default_factory=list)
    saving: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.requests

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 connector: KVConnector | None = None) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_kv: dict[str, Request] = {}
        self.ready: deque[tuple[Request, int]] = deque()  # KV complete: (request, first token)
        self.held: dict[str, Request] = {}
        self.num_computed_prompt_tokens = 0  # prompt tokens run through the model (not cache hits)
        self.num_preemptions = 0

    # ---- intake ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_remote(self, request: Request) -> None:
        """A request whose pages hold (or will hold) its prompt KV from another worker."""
        assert request.pages, "allocate the request's pages before waiting for its KV"
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_kv[request.request_id] = request

    def kv_received(self, request: Request, first_token: int) -> None:
        """The connector filled the request's pages: it joins the batch at the next free slot."""
        if self.waiting_kv.get(request.request_id) is request:
            del self.waiting_kv[request.request_id]
            self.ready.append((request, first_token))

    def kv_failed(self, request: Request) -> bool:
        """The request's KV will not come. Its pages return to the pool; False if it was not
        waiting for KV (a stale event). The caller decides between recompute and failure."""
        if self.waiting_kv.get(request.request_id) is not request:
            return False
        del self.waiting_kv[request.request_id]
        self.kv.free(request)
        return True

    def prefix_received(self, request: Request, num_tokens: int) -> None:
        """A fetched prefix (engine/prefix_fetch.py) is in the request's leading pages: it waits to
        prefill the rest, as after a prefix-cache hit of `num_tokens` (whole pages), which join
        the prefix cache now."""
        if self.waiting_kv.get(request.request_id) is request:
            del self.waiting_kv[request.request_id]
            request.num_computed_tokens = num_tokens
            self.kv.cache_full_pages(request)
            request.status = RequestStatus.WAITING
            self.waiting.append(request)

    def recompute(self, request: Request) -> None:
        """Queue a request to compute its prompt here from scratch (its KV was to come from elsewhere)."""
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        """Requests that a step can move now (those waiting for KV or held cannot)."""
        return bool(self.waiting or self.running or self.ready)

    @property
    def num_open(self) -> int:
        """Requests in the engine in any state, held ones included."""
        return len(self.waiting) + len(self.running) + len(self.waiting_kv) + len(self.ready) + len(self.held)

    # ---- endings --------------------------------------------------------------------------
    def abort(self, request: Request) -> None:
        self.finish(request, None)

    def finish(self, request: Request, error: str | None) -> None:
        """End a request in any live state: aborted (error None) or failed with `error`."""
        if request.status.finished:
            return
        rid = request.request_id
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif self.waiting_kv.get(rid) is request:
            del self.waiting_kv[rid]
        else:
            self.ready = deque((r, t) for r, t in self.ready if r is not request)
        if error is None:
            request.abort()
        else:
            request.fail(error)
        self.retire(request)

    def retire(self, request: Request) -> None:
        """A finished request leaves the batch. Its pages go back to the pool (full pages stay
        in the prefix cache), unless the connector still needs them: then they are held until
        `release`."""
        if self.connector is not None and self.connector.request_finished(request):
            self.held[request.request_id] = request
        else:
            self.kv.free(request)

    def release(self, request: Request) -> bool:
        """The connector is done with a held request's pages; False if it was not held."""
        if self.held.get(request.request_id) is not request:
            return False
        del self.held[request.request_id]
        self.kv.free(request)
        return True

    # ---- the step -------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self.ready:
            self._join_ready(batch)
        budget = self.max_num_batched_tokens
        decodes: list[tuple[Request, int]] = []  # decode-shaped (one token) go first, order kept
        others: list[tuple[Request, int]] = []
        allocate = self.kv.allocate
        running = self.running

        page_size = self.kv.page_size
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            n = len(req.all_token_ids) - computed
            if n > budget:
                n = budget
            # most steps a request's pages already hold its new tokens: no call to allocate
            if -(-(computed + n) // page_size) > len(req.pages) and not allocate(req, n):
                while True:
                    victim = running.pop()
                    self._preempt(victim)
                    batch.preempted.append(victim)
                    if victim is req or allocate(req, n):
                        break
                if victim is req:
                    break  # req itself was preempted: every request after it is gone too
            (decodes if n == 1 else others).append((req, n))
            budget -= n
            i += 1

        if not batch.preempted:
            while self.waiting and budget > 0 and len(running) < self.max_num_seqs:
                req = self.waiting[0]
                cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
                n = min(len(req.all_token_ids) - req.num_computed_tokens - len(cached) * page_size, budget)
                if not allocate(req, n, cached):
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:  # a fetched prefix (engine/prefix_fetch.py) counts as cached
                    req.num_cached_tokens = req.num_computed_tokens + len(cached) * page_size
                    req.metrics.first_scheduled_time = time.monotonic()
                req.num_computed_tokens += len(cached) * page_size
                req.status = RequestStatus.RUNNING
                running.append(req)
                (decodes if n == 1 else others).append((req, n))
                budget -= n

        requests, num_new = batch.requests, batch.num_new_tokens
        for req, n in decodes + others:
            computed, prompt = req.num_computed_tokens, req.num_prompt_tokens
            if computed < prompt:
                if req.kv_destinations and computed + n == prompt and req.num_output_tokens == 0:
                    # its last prompt chunk (not after a preemption: its KV was sent when first computed)
                    error = self.connector.start_save(req)
                    if error is not None:
                        self.finish(req, error)
                        batch.failed.append(req)
                        continue
                    batch.saving.append(req)
                self.num_computed_prompt_tokens += min(n, prompt - computed)
            requests.append(req)
            num_new.append(n)
        batch.num_decodes = sum(1 for n in num_new if n == 1)
        return batch

    def _join_ready(self, batch: ScheduledBatch) -> None:
        while self.ready and len(self.running) < self.max_num_seqs:
            req, first_token = self.ready.popleft()
            req.num_computed_tokens = req.num_tokens  # all it holds: the prompt (and a resumed request's output)
            req.num_cached_tokens = 0
            req.metrics.first_scheduled_time = time.monotonic()
            req.append_token(first_token)
            batch.joined.append(req)
            if req.status.finished:
                self.retire(req)
            else:
                req.status = RequestStatus.RUNNING
                self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, batch: ScheduledBatch, sampled: dict[Request, tuple[int, object]]) -> list[Request]:
        """Advance computed counts, append sampled tokens, retire finished requests.
        Returns every request whose output changed (finished ones included). A request that
        ended while the step ran (a send that failed at its finish) is skipped."""
        changed = []
        cache_full_pages = self.kv.cache_full_pages
        caching, page_size = self.kv.pool.enable_prefix_caching, self.kv.page_size
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req.status >= _FINISHED:
                continue
            computed = req.num_computed_tokens = req.num_computed_tokens + n
            if caching and computed // page_size > req.num_cached_pages_registered:  # a page filled
                cache_full_pages(req)
            out = sampled.get(req)
            if out is not None:
                req.append_token(out[0], out[1])
                changed.append(req)
                if req.status >= _FINISHED:
                    self.running.remove(req)
                    self.retire(req)
        return changed
