"""`KVStore`: one node's KV store, the tier below the workers' prefix caches (issue 37).

It is host memory laid out exactly as a worker's KV cache (per layer [num_pages, 2, page_size,
kv_heads, head_dim], the workers' dtype), registered with the same KV connector the workers use
(NIXL or gRPC, both roles), with a `BlockPool` over it: pages found by the chained hash of their
prefix, least recently used evicted first. It computes nothing. The router moves pages in and
out with the workers' own prefix-fetch protocol (engine/prefix_fetch.py), the store playing
either side:

    in  (offload)  store.offload(id, tokens) -> PrefixFetch for the full pages it lacks (its own
                   leading pages are skipped) -> the worker that holds them: export_prefix(fetch,
                   tokens) -> PREFIX_RECEIVED: the pages join the store's cache, at the LRU's back
                   (nothing sent, a FAILED receive, `abandon_fetch`: the pages are freed)
    out (fetch)    a worker's PrefixFetch -> store.export_prefix(fetch, tokens): the pages are
                   leased (one reference each: eviction cannot hand them out) until the send
                   ends, then back at the LRU's back

An offload finding every page already there only refreshes their place in the LRU. `pin(name,
tokens)` holds the cached leading pages of a prefix (a system prompt) against eviction until
`unpin(name)`. The store publishes KV events like an engine (engine/kv_events.py), so the
router's KV index knows what it holds, and answers `load()` with its pages.

Hosted like a worker: `engine.async_worker.AsyncWorker(KVStore(...))` in process, or as a Ray
actor (cluster/). Single-threaded: the host's loop thread runs every call and drains the
connector's events (`step`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from engine.block_hash import page_hashes
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVEventKind
from engine.kv_events import KVEventBatch, KVEventLog
from engine.load import WorkerLoad
from engine.outputs import PrefixExport, PrefixFetch
from engine.prefix_fetch import FetchPlan, PrefixTransfers
from engine.request import Request
from engine.sampling_params import SamplingParams
from kv_transfer import prefix
from kv_transfer.config import TransferConfig
from kv_transfer.descriptor import DestinationDescriptor
from kv_transfer.tp_connector import make_connector

_PARAMS = SamplingParams(max_tokens=1)


class KVStore:
    CALLS = ("offload", "export_prefix", "abandon_fetch", "kv_events", "pin", "unpin", "reset_prefix_cache",
             "stats")

    def __init__(self, model: str | Path, *, size_bytes: int, page_size: int = 16, dtype=None,
                 transport: str = "nixl", transfer_config: TransferConfig | None = None, model_id: str | None = None,
                 transport_kwargs: dict | None = None) -> None:
        import torch

        model_dir, cfg, self.dtype, self.page_bytes = _shape(model, page_size, dtype)
        self.model_dir = model_dir
        num_pages = size_bytes // self.page_bytes if isinstance(size_bytes, int) and size_bytes > 0 else 0
        if num_pages < 1:
            raise ValueError(f"kv_store.size must hold at least one page ({self.page_bytes} bytes: {page_size} tokens "
                             f"of {model_dir.name} in {str(self.dtype).removeprefix('torch.')}), got {size_bytes!r}")
        self.page_size = page_size
        self.kv = KVCacheManager(num_pages, page_size)
        shape = (num_pages, 2, page_size, cfg.num_kv_heads, cfg.head_dim)
        # empty, not zeros: the memory is committed page by page as pages are first written
        self.kv_caches = [torch.empty(shape, dtype=self.dtype) for _ in range(cfg.num_layers)]
        self.connector = make_connector(transport, transfer_config, model_id=model_id or model_dir.name, send=True,
                                        receive=True, transport_kwargs=transport_kwargs)
        self.connector.register_kv_caches(self.kv_caches)
        self.transfers = PrefixTransfers(self.kv, None)  # its holder half (export, leases) only
        self._ingesting: dict[str, tuple[Request, int]] = {}  # offload id -> (its record, tokens it had)
        self._pins: dict[str, list[int]] = {}
        self._events: KVEventLog | None = None
        self.num_offloads = 0            # offloads that received pages
        self.num_ingested_tokens = 0     # tokens received
        self.num_refreshed = 0           # offloads that found every page here already
        self.asked_tokens = 0            # tokens workers asked to fetch from here ...
        self.hit_tokens = 0              # ... and those sent (the store's hit rate)

    @staticmethod
    def page_bytes_of(model: str | Path, page_size: int = 16, dtype=None) -> int:
        """Bytes one page of `model`'s KV takes in a store (all layers, K and V)."""
        return _shape(model, page_size, dtype)[3]

    # ---- hosting (engine/loop.py) -------------------------------------------------------------
    @property
    def core(self) -> KVStore:
        return self

    def set_wakeup(self, fn: Callable[[], None]) -> None:
        self.connector.set_wakeup(fn)

    @property
    def has_work(self) -> bool:
        return self.connector.has_events

    @property
    def has_requests(self) -> bool:
        return bool(self._ingesting or self.transfers.exports)

    # what the tests' page-leak check reads of an engine: pages free (cached ones count as free)
    @property
    def num_free_pages(self) -> int:
        return self.kv.num_free_pages

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    def has_unfinished_requests(self) -> bool:
        return self.has_requests

    def step(self) -> list:
        for ev in self.connector.take_events():
            if self.transfers.on_event(ev):  # an export ended: its lease is released
                continue
            entry = self._ingesting.get(ev.request.request_id)
            if entry is None or entry[0] is not ev.request:
                continue
            del self._ingesting[ev.request.request_id]
            record, start = entry
            if ev.kind == KVEventKind.PREFIX_RECEIVED:
                record.num_computed_tokens = start + ev.num_tokens
                self.kv.cache_full_pages(record)
                self.num_offloads += 1
                self.num_ingested_tokens += ev.num_tokens
            self.kv.free(record)  # received pages stay cached (LRU's back); the rest are plain free
        return []

    # ---- in ---------------------------------------------------------------------------------
    def offload(self, request_id: str, token_ids: Sequence[int]) -> PrefixFetch | None:
        """Where a worker is to send the full pages of `token_ids` this store lacks (the router has
        the worker `export_prefix` it), or None: every page is here already (their place in the
        LRU is refreshed), or no page can be freed for them now (all leased or pinned)."""
        ps = self.page_size
        tokens = list(token_ids)
        k = len(tokens) // ps
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._ingesting:
            raise ValueError(f"offload {request_id!r} is already in flight")
        if k == 0:
            return None
        tokens = tokens[:k * ps]
        record = Request(request_id, tokens, _PARAMS, len(tokens) + 1)
        record.block_hashes = page_hashes(tokens, ps, [])
        have = self._leading(record)
        if len(have) == k:
            self.kv.pool.touch(have)
            self.kv.pool.free(reversed(have))  # to the LRU's back
            self.num_refreshed += 1
            return None
        # as many of the missing pages as can be freed for them, leading pages first
        room = self.kv.num_free_pages - sum(1 for p in have if self.kv.pool.ref_counts[p] == 0)
        n = min(k - len(have), room) * ps
        if n <= 0 or not self.kv.allocate(record, n, have):
            return None
        start = len(have) * ps
        try:
            where = self.connector.prepare_fetch(record, record.pages[len(have):], n)
        except BaseException:
            self.kv.free(record)
            raise
        self._ingesting[request_id] = (record, start)
        return prefix.fetch_of(request_id, FetchPlan(start, n, where))

    def abandon_fetch(self, request_id: str) -> bool:
        """The worker sends nothing for this offload: free its pages once nothing writes into them."""
        entry = self._ingesting.get(request_id)
        if entry is None:
            return False
        self.connector.cancel_fetch(entry[0])
        return True

    # ---- out --------------------------------------------------------------------------------
    def export_prefix(self, fetch: PrefixFetch, prompt_token_ids: Sequence[int]) -> PrefixExport:
        """Send a worker the cached pages its PrefixFetch asks for, leased until the send ends;
        fewer (possibly none) when the store no longer holds them all."""
        if not isinstance(fetch, PrefixFetch):
            raise ValueError(f"fetch must be a PrefixFetch, got {type(fetch).__name__}")
        dests = [DestinationDescriptor.from_bytes(d) if isinstance(d, bytes) else d for d in fetch.descriptors]
        sent, error = self.transfers.export(self.connector, fetch.request_id, list(prompt_token_ids),
                                            fetch.start_token, fetch.num_tokens, dests)
        self.asked_tokens += fetch.num_tokens
        self.hit_tokens += sent
        return PrefixExport(fetch.request_id, sent, fetch.num_tokens, error)

    # ---- pins -------------------------------------------------------------------------------
    def pin(self, name: str, token_ids: Sequence[int]) -> int:
        """Hold the cached leading full pages of `token_ids` against eviction under `name` (a
        pin of the same name is replaced). Returns the tokens pinned (0: none cached here)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"pin name must be a non-empty string, got {name!r}")
        ps = self.page_size
        tokens = list(token_ids)[:len(token_ids) // ps * ps]
        record = Request(f"pin:{name}", tokens or [0], _PARAMS, len(tokens) + 2)
        record.block_hashes = page_hashes(tokens, ps, [])
        pages = self._leading(record)
        self.kv.pool.touch(pages)
        self.unpin(name)
        self._pins[name] = pages
        return len(pages) * ps

    def unpin(self, name: str) -> bool:
        pages = self._pins.pop(name, None)
        if pages is None:
            return False
        self.kv.pool.free(reversed(pages))
        return True

    @property
    def pins(self) -> dict[str, int]:
        """Pinned tokens by pin name."""
        return {name: len(pages) * self.page_size for name, pages in self._pins.items()}

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the leading full pages of `token_ids` cached here."""
        ps = self.page_size
        tokens = list(token_ids)[:len(token_ids) // ps * ps]
        record = Request("lookup", tokens or [0], _PARAMS, len(tokens) + 2)
        record.block_hashes = page_hashes(tokens, ps, [])
        return len(self._leading(record)) * ps

    # ---- what the router reads ----------------------------------------------------------------
    def kv_events(self, epoch: str, since: int) -> KVEventBatch:
        if self._events is None:
            self._events = KVEventLog(self.page_size, self.kv.pool.cached_hashes)
            self.kv.pool.events = self._events
        return self._events.since(epoch, since)

    def load(self) -> WorkerLoad:
        return WorkerLoad(free_pages=self.kv.num_free_pages, total_pages=self.kv.num_pages,
                          transferring_requests=len(self._ingesting) + len(self.transfers.exports),
                          prefix_cache_hit_rate=self.hit_tokens / self.asked_tokens if self.asked_tokens else 0.0,
                          prefix_cache_queries=self.asked_tokens // self.page_size)

    def stats(self) -> dict:
        """Counters and sizes (tests, `ClusterStatus`)."""
        return dict(num_pages=self.kv.num_pages, free_pages=self.kv.num_free_pages,
                    cached_pages=self.kv.pool.num_cached_pages, page_bytes=self.page_bytes,
                    offloads=self.num_offloads, ingested_tokens=self.num_ingested_tokens,
                    refreshed=self.num_refreshed, exported_tokens=self.transfers.num_exported_tokens,
                    asked_tokens=self.asked_tokens,
                    ingesting=len(self._ingesting), exporting=len(self.transfers.exports),
                    pinned_pages=sum(len(p) for p in self._pins.values()))

    def reset_prefix_cache(self) -> int:
        """Forget every cached page not leased or pinned (tests, operators). Returns the pages
        that were cached."""
        n = self.kv.pool.num_cached_pages
        self.kv.pool.reset_prefix_cache()
        return n

    def close(self) -> None:
        self.connector.close()

    # ---- helpers ------------------------------------------------------------------------------
    def _leading(self, record: Request) -> list[int]:
        """The store's pages of the record's leading full pages."""
        pool, ps, tokens = self.kv.pool, self.page_size, record.all_token_ids
        pages: list[int] = []
        for i, h in enumerate(record.block_hashes[:len(tokens) // ps]):
            page = pool.lookup(h, tokens[i * ps:(i + 1) * ps])
            if page is None:
                break
            pages.append(page)
        return pages


def _shape(model: str | Path, page_size: int, dtype) -> tuple:
    """(checkpoint folder, ModelConfig, torch dtype, bytes per page) of a store for `model`."""
    import torch

    from engine.config import ModelConfig
    from engine.core import parse_dtype, resolve_model
    from engine.model_runner import page_bytes

    model_dir = resolve_model(model)
    cfg = ModelConfig.from_pretrained(model_dir)
    dt = parse_dtype(dtype, torch.float32)
    return model_dir, cfg, dt, page_bytes(cfg, page_size, dt)
