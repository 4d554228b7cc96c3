"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget (`max_num_batched_tokens`). Running requests are served first,
in arrival order: a decoding request takes one token, a request still prefilling takes the
rest of its prompt or whatever budget is left (a chunk). Then waiting requests are admitted,
oldest first, while budget, sequence slots and pages last; a newly admitted request first
takes its longest cached prefix from the prefix cache.

When a running request needs a page and none is free, the most recently arrived running
request is preempted: its pages go back to the pool (full ones stay findable in the prefix
cache) and it returns to the front of the waiting queue, to be recomputed from all its tokens
later. Nothing it generated is lost, and a seeded request keeps its generator state.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: (request, number of new tokens), decode-shaped (1 token) first."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.requests

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_computed_prompt_tokens = 0  # prompt tokens run through the model (not cache hits)
        self.num_preemptions = 0
        # Called instead of freeing a finished request's pages when set (a prefill worker
        # holds them until the KV transfer is done).
        self.on_retire: Callable[[Request], None] | None = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Join a request whose prompt KV is already in its pages (filled by a KV transfer):
        it has `num_computed_tokens` set and its next token appended, and decodes from the
        next step on. Preempting it later recomputes its KV here, like any other request."""
        assert request.pages and request.num_computed_tokens == request.num_tokens - 1
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = 0
        self.running.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request: Request) -> None:
        if request.status.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.abort()
        self.kv.free(request)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                chosen.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: every request after it is gone too

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
                n = min(req.num_tokens - req.num_computed_tokens - len(cached) * self.kv.page_size, budget)
                if not self.kv.allocate(req, n, cached):
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = len(cached) * self.kv.page_size
                    req.metrics.first_scheduled_time = time.monotonic()
                req.num_computed_tokens += len(cached) * self.kv.page_size
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                chosen.append((req, n))
                budget -= n

        chosen.sort(key=lambda rn: rn[1] != 1)  # stable: decode-shaped first, order kept
        batch = ScheduledBatch(preempted=preempted)
        for req, n in chosen:
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.num_computed_prompt_tokens += min(n, req.num_prompt_tokens - req.num_computed_tokens)
        batch.num_decodes = sum(1 for n in batch.num_new_tokens if n == 1)
        return batch

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, batch: ScheduledBatch, sampled: dict[Request, tuple[int, object]]) -> list[Request]:
        """Advance computed counts, append sampled tokens, retire finished requests.
        Returns every request whose output changed (finished ones included)."""
        changed = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            self.kv.cache_full_pages(req)
            if req in sampled:
                token, logprobs = sampled[req]
                req.append_token(token, logprobs)
                changed.append(req)
                if req.status.finished:
                    self.running.remove(req)
                    self.retire(req)
        return changed

    def retire(self, req: Request) -> None:
        """A finished request leaves the batch. Its pages go back to the pool (full pages stay
        in the prefix cache), unless `on_retire` takes them over."""
        if self.on_retire is not None:
            self.on_retire(req)
        else:
            self.kv.free(req)
