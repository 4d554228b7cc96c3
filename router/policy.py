"""Placement policies: which decode worker takes a request (first: it owns the destination
pages), then which prefill worker builds its KV. A policy sees `WorkerView`s (the latest
load report plus the router's own count of what it placed there and has not finished) and
the request's block hashes; it never calls a worker.

  round-robin   each role in turn, ignoring load
  least-loaded  decode: fewest in-flight, then most free pages; prefill: fewest queued tokens
  prefix-aware  prefill: most leading block hashes cached, less queued tokens; decode as
                least-loaded. "Cached" is the cluster's KV index (router/kv_index.py: the
                workers' own caches, from their KV events) for a worker whose index is
                exact; for one whose index is degraded (or with no index: the simulator), an
                approximate LRU of what this router sent where, capped at the worker's page
                count, and each such placement is counted (the kv_index_fallbacks metric).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.load import WorkerLoad
from router.kv_index import KVIndex

POLICIES = ("round-robin", "least-loaded", "prefix-aware")
WORKER_STATES = ("starting", "serving", "spare", "replacing", "unresponsive", "dead")  # docs/reliability.md


@dataclass(slots=True, eq=False)
class WorkerView:
    worker_id: str
    pool: str
    role: str
    load: WorkerLoad | None = None    # the worker's latest report, refreshed in the background
    healthy: bool = True
    error: str = ""
    state: str = "starting"           # one of WORKER_STATES
    pid: int = 0
    node: str = ""
    restarts: int = 0
    last_error: str = ""              # why it was last lost or out of placement
    failed_rejoins: int = 0           # warm-ups failed in a row since it was lost (backoff)
    inflight: int = 0                 # requests placed here by this router, not finished
    inflight_tokens: int = 0          # prompt tokens of those (prefill: not yet sampled)
    placed: int = 0
    cached: OrderedDict = field(default_factory=OrderedDict)  # block hash -> None, LRU order

    @property
    def free_pages(self) -> int:
        return self.load.free_pages if self.load is not None else 0

    @property
    def queued_tokens(self) -> int:
        reported = self.load.queued_tokens if self.load is not None else 0
        return max(reported, self.inflight_tokens)

    def matched_pages(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def remember(self, hashes: Sequence[int], capacity: int) -> None:
        for h in hashes:
            self.cached[h] = None
            self.cached.move_to_end(h)
        while len(self.cached) > capacity:
            self.cached.popitem(last=False)


class PlacementPolicy:
    name = "base"

    def pick_decode(self, views: Sequence[WorkerView], hashes: Sequence[int], num_tokens: int = 0) -> WorkerView:
        """`num_tokens`: the prompt's length (its full pages are `hashes`)."""
        raise NotImplementedError

    def pick_prefill(self, views: Sequence[WorkerView], hashes: Sequence[int],
                     fetch_saves: Mapping[str, float] | None = None) -> WorkerView:
        """`fetch_saves`: per worker id, the prompt tokens' worth of time a fetch of cached
        pages from elsewhere would save it (router.dispatch; policies that weigh no cache ignore it)."""
        raise NotImplementedError

    def pick_colocated(self, views: Sequence[WorkerView], hashes: Sequence[int]) -> WorkerView:
        """A worker that prefills the prompt itself and then decodes it."""
        return self.pick_decode(views, hashes)

    def remember(self, view: WorkerView, hashes: Sequence[int], capacity: int) -> None:
        """A prompt of these block hashes was placed on the worker, which caches its pages."""
        view.remember(hashes, capacity)

    def place(self, views: Sequence[WorkerView], hashes: Sequence[int], num_tokens: int = 0) -> WorkerView:
        """Where a request decodes: by the colocated rule when every candidate prefills its own
        prompts, else by the decode rule (its prefill is placed apart, or done there: a decode
        worker prefills a prompt locally when its uncached part there is short)."""
        if all(v.role == "colocated" for v in views):
            return self.pick_colocated(views, hashes)
        return self.pick_decode(views, hashes, num_tokens)


class RoundRobin(PlacementPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = {"decode": itertools.count(), "prefill": itertools.count()}

    def pick_decode(self, views, hashes, num_tokens=0):
        return views[next(self._turn["decode"]) % len(views)]

    def pick_prefill(self, views, hashes, fetch_saves=None):
        return views[next(self._turn["prefill"]) % len(views)]


class LeastLoaded(PlacementPolicy):
    name = "least-loaded"

    def pick_decode(self, views, hashes, num_tokens=0):
        return min(views, key=lambda v: (v.inflight, -v.free_pages, v.placed))

    def pick_prefill(self, views, hashes, fetch_saves=None):
        return min(views, key=lambda v: (v.queued_tokens, v.inflight, v.placed))


class PrefixAware(LeastLoaded):
    name = "prefix-aware"

    def __init__(self, page_size: int, index: KVIndex | None = None) -> None:
        self.page_size = page_size
        self.index = index

    # how many more requests in flight the decode worker holding a prompt's prefix may have than
    # the least loaded one and still be chosen for it
    AFFINITY_SLACK = 4

    def pick_decode(self, views, hashes, num_tokens=0):
        """The least loaded decode worker, unless one would prefill this prompt itself (its
        uncached part there is under the worker's `local_prefill_threshold`, by the KV index):
        then the one of those with the least left to prefill, the holder of the conversation
        so far, which computes only the new tokens and transfers nothing, within
        AFFINITY_SLACK requests of the least loaded."""
        least = super().pick_decode(views, hashes)
        index = self.index
        if index is None or not num_tokens:
            return least
        local = []
        for v in views:
            threshold = v.load.local_prefill_threshold if v.load is not None else 0
            if not threshold or v.inflight > least.inflight + self.AFFINITY_SLACK:
                continue
            uncached = num_tokens - self.cached_pages(v, hashes) * self.page_size
            if uncached < threshold:
                local.append((uncached, v.inflight, -v.free_pages, v.placed, v))
        return min(local, key=lambda x: x[:4])[4] if local else least

    def pick_prefill(self, views, hashes, fetch_saves=None):
        # An estimate of the first token's time, in prompt tokens: a cached page saves page_size
        # tokens of compute, a fetch of pages held elsewhere what it saves net of its own time,
        # queued tokens delay this one.
        saves = fetch_saves or {}
        return max(views, key=lambda v: (self.cached_pages(v, hashes) * self.page_size
                                         + saves.get(v.worker_id, 0.0) - v.queued_tokens, -v.inflight, -v.placed))

    def remember(self, view: WorkerView, hashes: Sequence[int], capacity: int) -> None:
        view.remember(hashes, capacity)
        if self.index is not None:
            self.index.expect(view.worker_id, hashes)

    def cached_pages(self, view: WorkerView, hashes: Sequence[int]) -> int:
        """Leading pages of the prompt the worker holds: exact from the index, else the LRU guess."""
        index = self.index
        if index is None:
            return view.matched_pages(hashes)
        if index.exact(view.worker_id):
            return index.matched_pages(view.worker_id, hashes)
        index.fallback(view.worker_id)
        return view.matched_pages(hashes)

    def pick_colocated(self, views, hashes):
        # It prefills here, so prefix hits and queued prompt tokens weigh as for a prefill
        # worker; then the streams it already decodes.
        return self.pick_prefill(views, hashes)


def make_policy(name: str, page_size: int, index: KVIndex | None = None) -> PlacementPolicy:
    """`index`: the cluster's KV index, for prefix-aware placement (None: the approximate LRU only)."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-aware":
        return PrefixAware(page_size, index)
    raise ValueError(f"policy must be one of {list(POLICIES)}, got {name!r}")
