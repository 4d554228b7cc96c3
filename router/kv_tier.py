"""`KVTier`: the router's side of the node KV stores (kv_store/, issue 37). The dispatcher owns one
when the cluster has stores; it does three things with them:

  offload   a request ended on a decode worker: the full pages of its prompt and answer (all but
            the last token, whose KV is never computed) go to the store of that worker's node,
            in the background: store.offload -> the pages it lacks (a PrefixFetch) -> the decode
            worker's export_prefix -> the store's cache. Nothing is asked when the index says the
            store holds them all; the decode worker's own cache is untouched.
  offer     for a prompt about to be prefilled, each healthy store's count of its leading pages,
            by the cluster's KV index (the stores publish KV events like engines): the
            dispatcher weighs them with the peers' offers (router/fetch_rule.py).
  watch     a load call per store at every refresh, and its KV events into the index; a store
            that does not answer is out of the offers (its index entry dropped) until it does.

Stores are not workers: they are never placed on, have no pool and no state machine beyond
healthy or not. Ray restarts a lost store (cluster/); its new process has a new event epoch, so
the index replaces its entry by a snapshot (empty).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_hash import page_hashes
from engine.load import WorkerLoad
from router.fetch_rule import FetchCosts, Offer
from router.handles import WorkerHandle
from router.kv_index import KVIndex, KVIndexSync
from router.pair_calls import first_line

log = logging.getLogger(__name__)

OFFLOAD_TIMEOUT_S = 30.0


@dataclass(slots=True, eq=False)
class StoreView:
    store_id: str
    handle: WorkerHandle
    node: str = ""
    healthy: bool = False      # answered its last load call
    error: str = "not heard from yet"
    load: WorkerLoad | None = None
    pid: int = 0


class KVTier:
    def __init__(self, stores: Sequence[WorkerHandle], index: KVIndex | None, sync: KVIndexSync | None,
                 costs: FetchCosts) -> None:
        self.stores = {h.worker_id: StoreView(h.worker_id, h) for h in stores}
        self.index, self.sync, self.costs = index, sync, costs
        self.offloads = {"stored": 0, "skipped": 0, "failed": 0}
        self.offloaded_tokens = 0
        self._tasks: set[asyncio.Task] = set()
        self._calls: dict[str, asyncio.Future] = {}

    # ---- watch ------------------------------------------------------------------------------
    async def refresh(self, timeout_s: float) -> None:
        """One load call pending per store at most (several refreshes may run at once: the
        background one and a ClusterStatus call), its answer applied the moment it comes."""
        async def one(view: StoreView) -> None:
            call = self._calls.get(view.store_id)
            if call is None:
                call = self._calls[view.store_id] = asyncio.ensure_future(view.handle.load())
                call.add_done_callback(lambda c, view=view: self._answer(view, c))
            calls = [call] + ([self.sync.pull(view.store_id, view.handle)] if self.sync and view.healthy else [])
            await asyncio.wait(calls, timeout=timeout_s)  # a store still busy keeps its last state

        await asyncio.gather(*(one(v) for v in self.stores.values()))

    def _answer(self, view: StoreView, call: asyncio.Future) -> None:
        if self._calls.get(view.store_id) is call:
            del self._calls[view.store_id]
        if call.cancelled():
            return
        exc = call.exception()
        if exc is None:
            load = call.result()
            if view.pid and load.pid != view.pid:
                log.warning("KV store %s restarted (process %d -> %d): it starts empty", view.store_id, view.pid,
                            load.pid)
            view.load, view.pid, view.node, view.healthy, view.error = load, load.pid, load.node, True, ""
        elif view.healthy or view.error == "not heard from yet":
            why = f"{type(exc).__name__}: {first_line(exc)}"
            view.healthy, view.error = False, why
            if self.index is not None:
                self.index.drop(view.store_id, f"store lost: {why}")
            log.warning("KV store %s is out of the tier: %s", view.store_id, why)

    def store_for(self, node: str) -> StoreView | None:
        """The healthy store of the node a worker runs on, if any."""
        for v in self.stores.values():
            if v.healthy and v.node == node:
                return v
        return None

    # ---- offer ------------------------------------------------------------------------------
    def offers(self, block_hashes: Sequence[int]) -> list[Offer]:
        """Each healthy store's leading pages of a prompt, by the exact index."""
        index = self.index
        if index is None:
            return []
        out = []
        for sid, v in self.stores.items():
            if v.healthy and index.exact(sid):
                n = index.matched_pages(sid, block_hashes)
                if n:
                    out.append(self.costs.offer(sid, n, "store"))
        return out

    def handle(self, store_id: str) -> WorkerHandle | None:
        v = self.stores.get(store_id)
        return v.handle if v is not None and v.healthy else None

    # ---- offload ----------------------------------------------------------------------------
    def offload(self, holder: WorkerHandle, node: str, request_id: str, token_ids: list[int],
                page_size: int) -> None:
        """In the background: the full pages of `token_ids` from `holder` into its node's store."""
        store = self.store_for(node)
        k = len(token_ids) // page_size
        if store is None or not k:
            return
        if self.index is not None and self.index.exact(store.store_id):
            hashes = page_hashes(token_ids[:k * page_size], page_size, [])
            if self.index.matched_pages(store.store_id, hashes) >= k:
                self.offloads["skipped"] += 1
                return
        task = asyncio.get_running_loop().create_task(self._offload(store, holder, request_id, token_ids))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _offload(self, store: StoreView, holder: WorkerHandle, request_id: str, token_ids: list[int]) -> None:
        rid = f"{request_id}.kv"
        t0 = time.monotonic()
        try:
            fetch = await asyncio.wait_for(store.handle.remote.call("call", "offload", rid, token_ids),
                                           OFFLOAD_TIMEOUT_S)
            if fetch is None:
                self.offloads["skipped"] += 1
                return
            try:
                exp = await asyncio.wait_for(holder.export_prefix(fetch, token_ids), OFFLOAD_TIMEOUT_S)
                sent = exp.num_tokens
            except Exception as exc:  # the decode worker is gone or busy: the store lets go of the pages
                sent = 0
                log.info("offload of %s from %s: %s", rid, holder.worker_id, first_line(exc))
            if sent <= 0:
                self.offloads["failed"] += 1
                await store.handle.abandon_fetch(rid)
                return
            self.offloads["stored"] += 1
            self.offloaded_tokens += sent
        except Exception as exc:
            self.offloads["failed"] += 1
            log.info("offload of %s into store %s failed after %.2f s: %s", rid, store.store_id,
                     time.monotonic() - t0, first_line(exc))

    async def close(self) -> None:
        for t in list(self._tasks) + list(self._calls.values()):
            t.cancel()
        await asyncio.gather(*self._tasks, *self._calls.values(), return_exceptions=True)
