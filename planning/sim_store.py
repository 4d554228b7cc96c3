"""The KV store tier and prefix fetches in the simulator (issue 37 item 6).

What the cluster does with a KV store per node (kv_store/, `kv_store.size` in the config), and
what the simulator therefore does:

- **Offload.** A request that finishes on a decode worker (disaggregated, or after a local
  prefill there; colocated workers have no KV connector) leaves the full pages of its prompt and
  output but the last token (whose KV is never computed) in the store of that worker's node:
  only the pages after the leading ones the store already holds are copied, and those it held
  are refreshed in its LRU (as kv_store.KVStore.offload does). The store is an LRU
  over page hashes with `size_bytes // bytes_per_page` pages; the pages one offload copies go in
  tail first, so a prompt's first page is the most recent and the last to go (as the engine's
  pool frees a request's pages). The copy is taken to be instant and to cost no worker time.
- **Fetch.** When the router places a prompt on a prefill worker whose own cache holds `have`
  of its leading pages, it lists offers (none when `router.fetch_min_pages` is 0: the router
  then never fetches): every store's leading pages of the prompt (stores first), then every
  other non-colocated worker's (the router's exact KV index: here the workers' engine caches
  themselves). `router.fetch_rule.choose`
  (the router's own rule) picks one or none. The worker then takes the prompt as the engine does
  for a prefix fetch (`engine.prefix_fetch.PrefixTransfers.fetch`: its own cached pages, pages
  allocated for the rest, waiting for remote KV), the pages arrive `overhead_s + extra_pages *
  s_per_page` later (no forward pass, no link shared with the KV transfers), and the rest of the
  prompt is prefilled as after a prefix-cache hit. Pages read from a store move to its recent end.
  A decode worker's local prefill does not fetch.
- **Costs** for the rule: `prefill_s_per_token` is the prefill pool's step time of one full
  token budget from an empty KV, per token; `s_per_page` is one page's bytes (per rank, as the
  KV transfers are timed) over the profile's measured bandwidth for the cluster's transport, else
  over the latency model's link (the roofline's network), else `DEFAULT_FETCH_S_PER_PAGE`; the
  overhead is `DEFAULT_FETCH_OVERHEAD_S` unless the cluster sets one.

A node is a pool's `host` when it has one (the pools a profile of this machine times share
"localhost"), else each worker is its own node. Like the prefix cache, the tier only runs for a
workload with shared prefix blocks: otherwise no page can be found again, and it would change
nothing but the time the simulation takes.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from itertools import islice, repeat, takewhile

from engine.kv_connector import KVEvent, KVEventKind
from engine.prefix_fetch import PrefixTransfers
from planning.sim_engine import EngineSim
from planning.sim_request import SimRequest
from router.fetch_rule import DEFAULT_FETCH_OVERHEAD_S, DEFAULT_FETCH_S_PER_PAGE, Offer, choose


class PageStore:
    """One node's KV store: an LRU over page hashes, `capacity` pages."""
    __slots__ = ("name", "capacity", "page_size", "bytes_per_page", "pages", "copied", "evicted", "fetches",
                 "fetched_pages")

    def __init__(self, name: str, capacity: int, page_size: int, bytes_per_page: int) -> None:
        self.name, self.capacity, self.page_size, self.bytes_per_page = name, capacity, page_size, bytes_per_page
        self.pages: OrderedDict = OrderedDict()  # page hash -> None, least recent first
        self.copied = self.evicted = self.fetches = self.fetched_pages = 0

    def leading(self, hashes: list[int], limit: int) -> int:
        """How many of the first `limit` pages of `hashes` the store holds, from the first on."""
        return len(list(takewhile(self.pages.__contains__, islice(hashes, limit))))

    def offload(self, hashes: list[int]) -> int:
        """Copy the pages after the leading ones already held; returns the pages copied."""
        if not self.capacity:
            return 0
        held = self.leading(hashes, len(hashes))
        new = hashes[held:]
        pages = self.pages
        deque(map(pages.pop, new, repeat(None)), maxlen=0)  # a page held further on is copied again
        pages.update(zip(reversed(new), repeat(None)))       # tail first: the leading page is the most recent
        # the pages it held already are refreshed too (kv_store.KVStore.offload): they go last, the
        # first of them last of all
        deque(map(pages.move_to_end, reversed(hashes[:held])), maxlen=0)
        if not new:
            return 0
        self.copied += len(new)
        over = len(pages) - self.capacity
        if over > 0:
            deque(map(pages.popitem, repeat(False, over)), maxlen=0)
            self.evicted += over
        return len(new)

    def read(self, hashes: list[int]) -> None:
        """Pages sent to a worker: each moves to the recent end (the first of them last)."""
        deque(map(self.pages.move_to_end, reversed(hashes)), maxlen=0)
        self.fetches += 1
        self.fetched_pages += len(hashes)

    def stats(self) -> dict:
        return {"capacity_pages": self.capacity, "bytes_per_page": self.bytes_per_page, "held_pages": len(self.pages),
                "copied_pages": self.copied, "evicted_pages": self.evicted, "fetches": self.fetches,
                "fetched_pages": self.fetched_pages}


def fetch_s_per_page(latency, page_bytes: int, transport: str) -> float:
    """Seconds one page takes to move (module docstring: the bandwidth's source)."""
    bw = latency.transfers[transport][1] if transport in latency.transfers else latency.transfer_bytes_per_s
    if page_bytes > 0 and 0 < bw < math.inf:
        return page_bytes / bw
    return DEFAULT_FETCH_S_PER_PAGE.get(transport, DEFAULT_FETCH_S_PER_PAGE["grpc"])


class KVTier:
    """The store tier and prefix fetches of one simulation. `pools_views`: (SimPool, SimView) per
    worker, in the simulator's order; `push(time, kind, obj)` schedules the simulator's event."""

    def __init__(self, cluster, pools_views: list, push) -> None:
        self.push = push
        self.min_pages = cluster.fetch_min_pages
        self.overhead_s = DEFAULT_FETCH_OVERHEAD_S if cluster.fetch_overhead_s is None else cluster.fetch_overhead_s
        self.stores: list[PageStore] = []
        self.store_of: dict[EngineSim, PageStore] = {}    # a decode worker -> its node's store
        by_node: dict[str, PageStore] = {}
        self.costs: dict[EngineSim, tuple[float, float]] = {}  # a prefill worker -> (s per token, s per page)
        self.peers: list[EngineSim] = []
        for pool, view in pools_views:
            w, lim, lm = view.worker, pool.limits, pool.latency
            if w.role == "colocated":
                continue
            self.peers.append(w)
            if w.role == "prefill":
                budget = lim.max_num_batched_tokens
                self.costs[w] = (lm.prefill_time(budget, 0) / budget,
                                 fetch_s_per_page(lm, lim.page_size * lm.kv_bytes_per_token, cluster.transport))
            elif cluster.kv_store_bytes:
                node = pool.host or w.name
                store = by_node.get(node)
                if store is None:
                    page_bytes = lim.page_size * lm.kv_bytes_per_token * pool.tp
                    cap = cluster.kv_store_bytes // page_bytes if page_bytes > 0 else 0
                    store = by_node[node] = PageStore(f"store:{node}", cap, lim.page_size, page_bytes)
                    self.stores.append(store)
                self.store_of[w] = store
        self.enabled = bool(self.stores) or self.min_pages > 0
        self.active = False
        self.transfers: dict[EngineSim, PrefixTransfers] = {}

    def start(self, shared: bool) -> None:
        """A run begins on fresh engines (`EngineSim.prefix_caching`); `shared`: the workload has
        shared prefix blocks (else the tier stays idle)."""
        self.active = self.enabled and shared
        for st in self.stores:
            st.pages.clear()
            st.copied = st.evicted = st.fetches = st.fetched_pages = 0
        self.transfers = {w: PrefixTransfers(w.kv, w.scheduler) for w in self.costs}

    # ---- the router's placement of a prompt on a prefill worker ---------------------------------
    def place(self, view, req: SimRequest, now: float) -> bool:
        """Fetch the prompt's leading pages for `view`'s worker if the rule says so: the request
        then waits for them (True; the simulator's event kind 6 at their arrival calls `arrived`).
        False: the caller queues it as usual."""
        w = view.worker
        cost = self.costs.get(w)
        if not self.active or cost is None or not self.min_pages:  # fetch_min_pages 0: the router never fetches
            return False
        ps = w.limits.page_size
        most = (req.prompt_len - 1) // ps  # the last prompt token is always computed
        if most < 1:
            return False
        have = w.cached_prefix_tokens(req) // ps
        if have >= most:
            return False
        hashes = req.page_hashes(ps)
        offers, source = [], {}
        for st in self.stores:
            if st.capacity and st.page_size == ps:
                n = st.leading(hashes, most)
                if n > have:
                    offers.append(Offer(st.name, n, cost[1]))
                    source[st.name] = st
        for peer in self.peers:
            if peer is not w and peer.limits.page_size == ps:
                n = _cached_pages(peer, hashes, most)
                if n > have:
                    offers.append(Offer(peer.name, n, cost[1]))
        if not offers:
            return False
        pick = choose(have, offers, ps, cost[0], self.overhead_s, self.min_pages)
        if pick is None:
            return False
        plan = self.transfers[w].fetch(w.scheduler.connector, w.engine_request(req), pick.pages)
        if plan is None:  # pages short: computed here
            return False
        extra = plan.num_tokens // ps
        req.fetched, req.fetch_from = plan.num_tokens, "store" if pick.holder in source else "peer"
        st = source.get(pick.holder)
        if st is not None:
            st.read(hashes[pick.pages - extra:pick.pages])
        self.push(now + self.overhead_s + extra * cost[1], 6, (view, req))
        return True

    def arrived(self, w: EngineSim, req: SimRequest) -> None:
        """The fetched pages are in the worker's pages: the rest of the prompt waits to prefill."""
        w.sync()
        self.transfers[w].on_event(KVEvent(KVEventKind.PREFIX_RECEIVED, w.engine_request(req),
                                           num_tokens=req.fetched))

    # ---- the end of a request ------------------------------------------------------------------
    def offload(self, w: EngineSim, req: SimRequest) -> None:
        """`req` finished on worker `w`: its pages go to the node's store (module docstring)."""
        st = self.store_of.get(w) if self.active else None
        if st is not None:
            st.offload(req.kv_page_hashes(st.page_size))

    def summary(self, reqs: list[SimRequest]) -> dict:
        return tier_summary(reqs, self)


def _cached_pages(w: EngineSim, hashes: list[int], limit: int) -> int:
    """Leading pages of `hashes` in worker `w`'s prefix cache, without taking them or counting a
    query of its pool (as an export's lookup: engine/prefix_fetch.py)."""
    if not w.kv.pool.enable_prefix_caching:
        return 0
    w.sync()
    pool = w.kv.pool
    counted = pool.queries, pool.hits
    n = len(list(takewhile(lambda h: pool.lookup(h, ()) is not None, islice(hashes, limit))))
    pool.queries, pool.hits = counted
    return n


def tier_summary(reqs: list[SimRequest], tier: KVTier | None = None) -> dict:
    """Where the prompt tokens of the requests that reached their first token came from: the
    worker's own prefix cache, a peer's, a store, or computed (first admission; recomputes after a
    preemption are the workers' `computed_prompt_tokens`), with each tier's share and the fetches."""
    prompt = own = peer = store = 0
    fetches = {"peer": 0, "store": 0}
    for r in reqs:
        if not r.token_times:
            continue
        prompt += r.prompt_len
        cached = max(r.cached, 0)
        own += cached - r.fetched
        if r.fetch_from == "store":
            store += r.fetched
            fetches["store"] += 1
        elif r.fetch_from:
            peer += r.fetched
            fetches["peer"] += 1
    computed = prompt - own - peer - store
    tokens = {"own_cache": own, "peer": peer, "store": store, "computed": computed}
    rate = {k: (v / prompt if prompt else 0.0) for k, v in tokens.items() if k != "computed"}
    rate["total"] = sum(rate.values())
    out = {"prompt_tokens": prompt, "tokens": tokens, "hit_rate": rate, "fetches": fetches}
    if tier is not None:
        out.update(active=tier.active, fetch_min_pages=tier.min_pages, fetch_overhead_s=tier.overhead_s,
                   stores={st.name: st.stats() for st in tier.stores},
                   fetch_costs={w.name: {"prefill_s_per_token": c[0], "s_per_page": c[1]}
                                for w, c in tier.costs.items()})
    return out
