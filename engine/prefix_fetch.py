"""Prefix fetch: a worker about to prefill a prompt whose leading pages another worker holds in
its prefix cache pulls their KV over the KV connector (engine/kv_connector.py) and prefills only
the rest. Both halves live here; EngineCore owns one `PrefixTransfers` and calls it.

Requester (`fetch`), a request admitted with a remote prefix of k pages:

    its own cached leading pages m (<= k) are taken as usual, pages m..k-1 allocated
    -> connector.prepare_fetch: the descriptor for those pages (the router hands it to the holder)
    -> WAITING_FOR_REMOTE_KV (the scheduler's waiting_kv) until the connector's event:
       PREFIX_RECEIVED(j tokens, whole pages, j may be short of asked) -> WAITING with
           num_computed_tokens = m * page_size + j, those pages registered in the prefix cache:
           the rest is prefilled exactly as after a local prefix-cache hit
       FAILED (holder gone or evicted, deadline, `abandon`) -> pages freed, WAITING from token 0:
           the whole prompt is computed here (the output is the same either way)
    abort while fetching -> the receive is cancelled; pages held until nothing writes into them

Holder (`export`): the pages of tokens [start, start + n) found in the prefix cache (a lookup
compares token ids: a page evicted and reused is never sent) are pinned (one more reference each,
so eviction cannot hand them out), and sent through connector.start_export with no forward pass;
they are unpinned when the connector releases the export. Pages missing from the cache cut the
export to the leading pages it has (possibly none: nothing is sent).

No torch here, and no transport: the connector does the moving.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.block_hash import page_hashes
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnector, KVEvent, KVEventKind, prefix_transfer_id
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

_EXPORT_PARAMS = SamplingParams(max_tokens=1)


@dataclass(slots=True, frozen=True)
class FetchPlan:
    """What a requester asks the holder for: tokens [start_token, start_token + num_tokens) into
    `destination` (the connector's descriptor; a list at tensor parallelism, unsupported yet)."""

    start_token: int
    num_tokens: int
    destination: object


class PrefixTransfers:
    def __init__(self, kv: KVCacheManager, scheduler: Scheduler) -> None:
        self.kv, self.scheduler = kv, scheduler
        self.fetching: dict[str, tuple[Request, int]] = {}  # request id -> (request, tokens it had cached)
        self._fetch_t0: dict[str, float] = {}   # request id -> when its fetch was planned
        self.exports: dict[str, Request] = {}   # transfer id -> the export's record (its pinned pages)
        self.num_fetched_tokens = 0             # prefix tokens received (not computed here)
        self.num_failed_fetches = 0             # fetches that ended in a recompute
        self.num_exported_tokens = 0            # prefix tokens this worker sent

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    # ---- requester --------------------------------------------------------------------------
    def fetch(self, connector: KVConnector, req: Request, num_pages: int) -> FetchPlan | None:
        """Allocate the prefix's pages and publish where the holder writes; None when there is
        nothing to fetch (the engine holds all k pages itself, or pages are short): the caller
        then queues the request as usual."""
        ps = self.page_size
        most = (req.num_tokens - 1) // ps  # the last prompt token is always computed here
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or not 1 <= num_pages <= most:
            raise ValueError(f"remote_prefix num_pages must be in [1, {most}] for a prompt of {req.num_tokens} "
                             f"tokens and pages of {ps}, got {num_pages!r}")
        local = self.kv.find_cached_prefix(req)[:num_pages]
        if len(local) == num_pages or not self.kv.allocate(req, (num_pages - len(local)) * ps, local):
            return None
        start, n = len(local) * ps, (num_pages - len(local)) * ps
        try:
            where = connector.prepare_fetch(req, req.pages[len(local):], n)
        except BaseException:
            self.kv.free(req)
            raise
        self.fetching[req.request_id] = (req, start)
        self._fetch_t0[req.request_id] = time.monotonic()
        self.scheduler.add_remote(req)
        return FetchPlan(start, n, where)

    def abandon(self, connector: KVConnector, request_id: str) -> bool:
        """Give up a fetch in flight: the request computes its whole prompt here once the
        receive lets go of its pages. False if the request is not fetching."""
        entry = self.fetching.get(request_id)
        if entry is None:
            return False
        connector.cancel_fetch(entry[0])
        return True

    def forget(self, request_id: str) -> None:
        """The request ended (aborted): its receive ends with the scheduler's retire."""
        self.fetching.pop(request_id, None)
        self._fetch_t0.pop(request_id, None)

    # ---- holder -----------------------------------------------------------------------------
    def export(self, connector: KVConnector, request_id: str, token_ids: list[int], start_token: int,
               num_tokens: int, dests: list) -> tuple[int, str | None]:
        """Pin the cached pages of tokens [start_token, start_token + num_tokens) and send them.
        Returns (tokens being sent, error): (0, None) when the cache holds not even the first."""
        ps = self.page_size
        if start_token < 0 or start_token % ps or num_tokens < 1 or num_tokens % ps:
            raise ValueError(f"an export moves whole pages of {ps} tokens: start_token={start_token}, "
                             f"num_tokens={num_tokens}")
        if start_token + num_tokens > len(token_ids):
            raise ValueError(f"token_ids has {len(token_ids)} tokens, the export asks for tokens up to "
                             f"{start_token + num_tokens}")
        tid = prefix_transfer_id(request_id)
        if tid in self.exports:
            raise ValueError(f"request {request_id!r} is already being exported")
        end = start_token + num_tokens
        hashes = page_hashes(token_ids[:end], ps, [])
        pool = self.kv.pool
        counted = pool.queries, pool.hits  # the hit rate is about the prompts this worker serves, not its exports
        pages: list[int] = []
        for i in range(start_token // ps, end // ps):
            page = pool.lookup(hashes[i], token_ids[i * ps:(i + 1) * ps])
            if page is None:
                break
            pages.append(page)
        pool.queries, pool.hits = counted
        if not pages:
            return 0, None
        self.kv.pool.touch(pages)  # pinned: eviction cannot hand them out until the release
        record = Request(tid, token_ids[:end], _EXPORT_PARAMS, end + 1, pages=pages)
        self.exports[tid] = record
        sent = len(pages) * ps
        try:
            error = connector.start_export(record, dests, sent)  # RELEASED(record) follows in every case
        except BaseException:
            del self.exports[tid]
            self.kv.free(record)
            raise
        if error is not None:
            return 0, error
        self.num_exported_tokens += sent
        return sent, None

    # ---- events -----------------------------------------------------------------------------
    def on_event(self, ev: KVEvent) -> bool:
        """Apply a connector event that belongs to a fetch or an export; False if it does not."""
        req = ev.request
        if self.exports.get(req.request_id) is req:
            if ev.kind == KVEventKind.RELEASED:
                del self.exports[req.request_id]
                self.kv.free(req)
            return True
        entry = self.fetching.get(req.request_id)
        if entry is None or entry[0] is not req:
            return False
        del self.fetching[req.request_id]
        t0 = self._fetch_t0.pop(req.request_id, None)
        if ev.kind == KVEventKind.PREFIX_RECEIVED:
            self.num_fetched_tokens += ev.num_tokens
            if t0 is not None:
                req.metrics.fetch_s = time.monotonic() - t0
            self.scheduler.prefix_received(req, entry[1] + ev.num_tokens)
        elif self.scheduler.kv_failed(req):  # FAILED: compute it all here
            self.num_failed_fetches += 1
            self.scheduler.recompute(req)
        return True
