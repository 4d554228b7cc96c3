"""Prometheus metrics and per-request log lines of one router.

Each router owns a `RouterMetrics` with its own CollectorRegistry (never the global one), so
several routers in one process, or a test's routers, never collide. The service observes
request histograms and counters on its hot path (one histogram observation per chunk at
most); worker gauges are read at scrape time from the load views the dispatcher already
refreshes for placement, so a scrape costs no worker RPC. `serve(host, port)` exposes the
registry as text at http://host:port/metrics.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.heap import GcPauseStats, gc_pauses
from router.kv_index import KVIndex
from router.policy import WORKER_STATES, WorkerView

request_log = logging.getLogger("pdcluster.requests")

# 1 ms .. ~60 s, roughly x2.5 per bucket
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
# 4 KiB .. 4 GiB, x4 per bucket: a tiny test model's few pages up to a 7B model's long prompt
BYTES_BUCKETS = tuple(float(4096 * 4 ** i) for i in range(11))


class WorkerCollector(Collector):
    """Worker gauges labelled {worker, pool, role}, read off the dispatcher's load views."""

    def __init__(self, views: Callable[[], Mapping[str, WorkerView]]) -> None:
        self._views = views

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["worker", "pool", "role"]
        fams = {name: GaugeMetricFamily(f"pdcluster_{name}", doc, labels=labels) for name, doc in (
            ("kv_pages_used", "KV pages in use (total - free)"),
            ("kv_pages_free", "free KV pages"),
            ("kv_pages_total", "KV pages of the worker"),
            ("worker_running_requests", "requests running on the worker"),
            ("worker_waiting_requests", "requests waiting on the worker (queued, for pages or for KV)"),
            ("prefix_cache_hit_rate", "prefix-cache hit rate, 0..1"),
            ("worker_healthy", "1 when the last load refresh answered"))}
        state = GaugeMetricFamily("pdcluster_worker_state", "1 for the worker's state (docs/reliability.md), 0 for "
                                  "the others", labels=[*labels, "state"])
        for v in list(self._views().values()):
            ld, lv = v.load, [v.worker_id, v.pool, v.role]
            fams["worker_healthy"].add_metric(lv, 1.0 if v.healthy else 0.0)
            for s in WORKER_STATES:
                state.add_metric([*lv, s], 1.0 if v.state == s else 0.0)
            if ld is None:
                continue
            fams["kv_pages_total"].add_metric(lv, ld.total_pages)
            fams["kv_pages_free"].add_metric(lv, ld.free_pages)
            fams["kv_pages_used"].add_metric(lv, ld.total_pages - ld.free_pages)
            fams["worker_running_requests"].add_metric(lv, ld.running_requests)
            fams["worker_waiting_requests"].add_metric(lv, ld.waiting_requests)
            fams["prefix_cache_hit_rate"].add_metric(lv, ld.prefix_cache_hit_rate)
        yield from fams.values()
        yield state


class KVIndexCollector(Collector):
    """The KV index's state (router/kv_index.py), read at scrape time: per worker whether it is
    exact, its blocks, events applied and placements that fell back to the approximate LRU;
    snapshots by reason; distinct blocks cluster-wide."""

    def __init__(self, index: KVIndex, views: Callable[[], Mapping[str, WorkerView]] | None) -> None:
        self._index, self._views = index, views

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["worker", "pool", "role"]
        exact = GaugeMetricFamily("pdcluster_kv_index_exact", "1 while the router's KV index of the worker's prefix "
                                  "cache is exact (placement routes by it), 0 while degraded or unknown", labels=labels)
        blocks = GaugeMetricFamily("pdcluster_kv_index_worker_blocks", "block hashes indexed for the worker",
                                   labels=labels)
        events = CounterMetricFamily("pdcluster_kv_index_events", "KV events applied to the index", labels=labels)
        fallbacks = CounterMetricFamily("pdcluster_kv_index_fallbacks", "placements that judged the worker by the "
                                        "router's approximate LRU because its index was not exact", labels=labels)
        views = dict(self._views()) if self._views is not None else {}
        for wid, w in list(self._index.workers.items()):
            v = views.get(wid)
            lv = [wid, v.pool if v is not None else "", v.role if v is not None else ""]
            exact.add_metric(lv, 1.0 if w.state == "exact" else 0.0)
            blocks.add_metric(lv, len(w.blocks))
            events.add_metric(lv, w.events)
            fallbacks.add_metric(lv, w.fallbacks)
        snapshots = CounterMetricFamily("pdcluster_kv_index_snapshots", "full snapshots of a worker's prefix cache "
                                        "taken, by reason", labels=["reason"])
        for reason, n in self._index.snapshots.items():
            snapshots.add_metric([reason], n)
        total = GaugeMetricFamily("pdcluster_kv_index_blocks", "distinct block hashes cached on any worker")
        total.add_metric([], self._index.num_blocks)
        yield from (exact, blocks, events, fallbacks, snapshots, total)


class GcCollector(Collector):
    """Garbage-collection pauses of the router's process and of every worker's (from its load
    view), labelled {process} = "router" or the worker id: see engine.heap for why they matter."""

    def __init__(self, views: Callable[[], Mapping[str, WorkerView]] | None) -> None:
        self._views = views
        gc_pauses()  # start timing this process's collections

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        count = CounterMetricFamily("pdcluster_gc_collections", "garbage collections", labels=["process", "generation"])
        secs = CounterMetricFamily("pdcluster_gc_pause_seconds", "time spent in garbage collections",
                                   labels=["process", "generation"])
        longest = GaugeMetricFamily("pdcluster_gc_max_pause_seconds", "longest garbage collection", labels=["process"])
        frozen = GaugeMetricFamily("pdcluster_gc_frozen_objects", "startup objects exempt from collection",
                                   labels=["process"])
        procs: list[tuple[str, GcPauseStats]] = [("router", gc_pauses().stats())]
        if self._views is not None:
            procs += [(v.worker_id, v.load.gc) for v in list(self._views().values())
                      if v.load is not None and v.load.gc is not None]
        for name, st in procs:
            for gen in range(3):
                count.add_metric([name, str(gen)], st.collections[gen])
                secs.add_metric([name, str(gen)], st.seconds[gen])
            longest.add_metric([name], st.max_seconds)
            frozen.add_metric([name], st.frozen_objects)
        yield from (count, secs, longest, frozen)


class FetchCollector(Collector):
    """Prefix fetches the router drove (router.dispatch.Dispatcher.fetch_counts), read at scrape time."""

    def __init__(self, dispatcher) -> None:
        self._d = dispatcher

    def collect(self) -> Iterable[CounterMetricFamily]:
        fetches = CounterMetricFamily("pdcluster_kv_fetches", "prompt prefixes a prefill worker was to fetch from a "
                                      "peer's cache: fetched, or recomputed (the holder sent nothing)",
                                      labels=["outcome"])
        for outcome, n in self._d.fetch_counts.items():
            fetches.add_metric([outcome], n)
        tokens = CounterMetricFamily("pdcluster_kv_fetched_tokens", "prompt tokens fetched from a peer's cache "
                                     "instead of computed")
        tokens.add_metric([], self._d.fetched_tokens)
        by_source = CounterMetricFamily("pdcluster_kv_fetched_tokens_by_source", "prompt tokens fetched instead of "
                                        "computed, by where they came from: a node's KV store or a worker",
                                        labels=["source"])
        for source, n in self._d.fetched_by_source.items():
            by_source.add_metric([source], n)
        yield from (fetches, tokens, by_source)
        tier = self._d.tier
        if tier is None:
            return
        offloads = CounterMetricFamily("pdcluster_kv_store_offloads", "finished requests whose pages the router had "
                                       "copied into their node's KV store: stored, skipped (all there already) or "
                                       "failed", labels=["outcome"])
        for outcome, n in tier.offloads.items():
            offloads.add_metric([outcome], n)
        offloaded = CounterMetricFamily("pdcluster_kv_store_offloaded_tokens", "tokens of KV copied into the stores")
        offloaded.add_metric([], tier.offloaded_tokens)
        pages = GaugeMetricFamily("pdcluster_kv_store_pages", "a KV store's pages: total, and free (not leased or "
                                  "pinned; cached pages count as free)", labels=["store", "node", "kind"])
        healthy = GaugeMetricFamily("pdcluster_kv_store_healthy", "1 while the store answers and is offered",
                                    labels=["store", "node"])
        hits = GaugeMetricFamily("pdcluster_kv_store_hit_rate", "tokens a store sent over the tokens asked of it",
                                 labels=["store", "node"])
        for sid, v in tier.stores.items():
            healthy.add_metric([sid, v.node], 1.0 if v.healthy else 0.0)
            if v.load is not None:
                pages.add_metric([sid, v.node, "total"], v.load.total_pages)
                pages.add_metric([sid, v.node, "free"], v.load.free_pages)
                hits.add_metric([sid, v.node], v.load.prefix_cache_hit_rate)
        yield from (offloads, offloaded, pages, healthy, hits)


class RouterMetrics:
    def __init__(self, views: Callable[[], Mapping[str, WorkerView]] | None = None,
                 kv_index: KVIndex | None = None, dispatcher=None) -> None:
        self.registry = r = CollectorRegistry()
        h = lambda name, doc: Histogram(name, doc, buckets=SECONDS_BUCKETS, registry=r)
        self.ttft = h("pdcluster_request_ttft_seconds", "arrival to the first token sent")
        self.itl = h("pdcluster_request_itl_seconds", "gap between consecutive chunks sent")
        self.e2e = h("pdcluster_request_e2e_seconds", "arrival to the final response")
        self.queue = h("pdcluster_request_queue_seconds", "wait for an admission slot")
        self.prefill = h("pdcluster_request_prefill_seconds", "prefill submit to its first token")
        self.transfer = h("pdcluster_kv_transfer_seconds", "first token to the decode worker's first output")
        self.transfer_bytes = Histogram("pdcluster_kv_transfer_bytes", "KV bytes moved prefill -> decode per request",
                                        buckets=BYTES_BUCKETS, registry=r)
        self.requests = Counter("pdcluster_requests", "finished requests", ["finish_reason"], registry=r)
        self.errors = Counter("pdcluster_request_errors", "refused or failed requests", ["code"], registry=r)
        self.prompt_tokens = Counter("pdcluster_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdcluster_generation_tokens", "tokens generated and sent", registry=r)
        self.running = Gauge("pdcluster_router_running_requests", "requests holding an admission slot", registry=r)
        self.waiting = Gauge("pdcluster_router_waiting_requests", "requests waiting for a slot", registry=r)
        if views is not None:
            r.register(WorkerCollector(views))
        r.register(GcCollector(views))
        if kv_index is not None:
            r.register(KVIndexCollector(kv_index, views))
        if dispatcher is not None:
            r.register(FetchCollector(dispatcher))

    def asgi_app(self):
        """An ASGI app serving the Prometheus text at GET /metrics (router.server serves it, with
        the router's TLS and keys)."""
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        async def metrics(request):
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


def log_request(fields: dict) -> None:
    """One JSON line per finished (or failed) request on logger `pdcluster.requests`."""
    if request_log.isEnabledFor(logging.INFO):
        request_log.info(json.dumps(fields, separators=(",", ":")))
