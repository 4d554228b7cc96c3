"""The Dispatcher's use of the cluster's KV cache beyond one worker (`KVFetch`, a mixin of
router.dispatch's `Dispatcher`; docs/kv-cache.md):

  _fetch_plans     for each candidate prefill worker, the fetch of cached leading pages worth
                   making instead of computing them (offers from the nodes' KV stores and the
                   serving workers, by the exact KV index, weighed by router/fetch_rule.py); the
                   placement counts what each would save (router/policy.py)
  _local_fetch     the same for a decode worker that would prefill the prompt itself
  _fetch           have the holder send the pages; when it sends nothing, the requester computes
                   the whole prompt (the client sees no difference)
  _offload         after a request: its pages into the decode worker's node's store (router/kv_tier.py)
  _expect_conversation
                   after a request: the decode worker caches prompt + answer, for the next turn

It relies on these attributes, set in `Dispatcher.__init__`: `views`, `handles`, `policy`,
`kv_index`, `tier`, `fetch_costs`, `fetch_min_pages`, `fetch_timeout_s`, `fetch_counts`,
`fetched_tokens` and `fetched_by_source`.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from engine.block_hash import page_hashes
from router.fetch_rule import best_offer
from router.frontend import PreparedRequest
from router.handles import WorkerHandle
from router.pair_calls import first_line as _first_line
from router.policy import WorkerView

log = logging.getLogger("router.dispatch")  # the dispatcher's log, as before the split


def capacity(view: WorkerView) -> int:
    """Pages the router's approximate LRU of a worker's cache holds at most."""
    return max(view.load.total_pages if view.load is not None else 0, 1024)


class KVFetch:
    """Fetches, offloads and expected pages: the dispatcher's KV-cache half (module docstring).
    `live` arguments are router.dispatch's _Live records of a request's placement."""

    def _fetch_plans(self, candidates: Sequence[WorkerView], req: PreparedRequest) -> dict[str, tuple]:
        """For each candidate prefill worker, the fetch worth making instead of computing the
        prompt's leading pages there: {worker id: (Offer, gain in seconds)}; a candidate with
        none is absent. Offers come from the nodes' KV stores and the serving workers, by the
        exact KV index; router/fetch_rule.py weighs each against computing its pages
        (`fetch_min_pages`: the fewest extra pages worth a fetch; 0: never fetch). Colocated
        workers have no connector: neither side."""
        index = self.kv_index
        if index is None or not self.fetch_min_pages:
            return {}
        costs = self.fetch_costs
        # the last prompt token is always computed where the prompt is prefilled
        hashes = req.block_hashes[:(len(req.prompt_token_ids) - 1) // index.page_size]
        held = self.tier.offers(hashes) if self.tier is not None else []
        for wid, view in self.views.items():
            if view.role != "colocated" and view.state == "serving" and index.exact(wid):
                n = index.matched_pages(wid, hashes)
                if n:
                    held.append(costs.offer(wid, n, "worker"))
        if not held:
            return {}
        plans = {}
        for v in candidates:
            if not index.exact(v.worker_id):
                continue
            best, gain = best_offer(index.matched_pages(v.worker_id, hashes),
                                    [o for o in held if o.holder != v.worker_id], index.page_size,
                                    costs.prefill_s_per_token, costs.overhead_s, self.fetch_min_pages)
            if best is not None:
                plans[v.worker_id] = (best, gain)
        return plans

    def _local_fetch(self, dview: WorkerView, req: PreparedRequest) -> tuple | None:
        """(Offer, gain) when the decode worker should prefill this prompt itself after fetching
        its cached leading pages from elsewhere: it prefills locally what is short of its
        `local_prefill_threshold`, and with the fetch the uncached rest would be."""
        threshold = dview.load.local_prefill_threshold if dview.load is not None else 0
        if not threshold or dview.role != "decode" or self.kv_index is None:
            return None
        plan = self._fetch_plans([dview], req).get(dview.worker_id)
        if plan is None or len(req.prompt_token_ids) - plan[0].pages * self.kv_index.page_size >= threshold:
            return None
        return plan

    async def _fetch(self, requester: WorkerHandle, holder_id: str, fetch, prompt: list[int]) -> int:
        """Have `holder_id` send the prefix `fetch` asks for into the requester's pages; when it
        sends nothing (its pages evicted meanwhile, lost, an error), the requester computes the
        whole prompt instead. Returns the prompt tokens fetched (the client sees no difference)."""
        holder = self.handles.get(holder_id) or (self.tier.handle(holder_id) if self.tier is not None else None)
        sent, why = 0, "the holder left placement"
        if holder is not None:
            try:
                exp = await asyncio.wait_for(holder.export_prefix(fetch, prompt), self.fetch_timeout_s)
                sent, why = exp.num_tokens, exp.error or "its cache no longer holds the pages"
            except Exception as exc:  # lost, fenced, timed out: recompute
                why = f"{type(exc).__name__}: {_first_line(exc)}"
        if sent > 0:
            self.fetch_counts["fetched"] += 1
            self.fetched_tokens += sent
            self.fetched_by_source["worker" if holder_id in self.handles else "store"] += sent
            return sent
        self.fetch_counts["recomputed"] += 1
        log.info("prefix fetch of %s from %s: nothing sent (%s); computing the prompt instead", fetch.request_id,
                 holder_id, why)
        try:
            await requester.abandon_fetch(fetch.request_id)
        except Exception as exc:  # the requester is gone: its result says so
            log.warning("abandon_fetch of %s on %s: %s", fetch.request_id, requester.worker_id, _first_line(exc))
        return 0

    def _offload(self, live, req: PreparedRequest, output: Sequence[int]) -> None:
        """The decode worker holds the full pages of prompt + answer: its node's KV store takes a
        copy of those it lacks, in the background (router/kv_tier.py)."""
        view = self.views.get(live.decode.worker_id)
        size = self.kv_index.page_size if self.kv_index is not None else 0
        if self.tier is None or view is None or view.role != "decode" or not size or len(output) < 2:
            return
        tokens = list(req.prompt_token_ids) + list(output[:-1])
        self.tier.offload(live.decode, view.node, live.worker_rid, tokens, size)

    def _expect_conversation(self, live, req: PreparedRequest, output: Sequence[int]) -> None:
        """The decode worker now caches the full pages of prompt + answer (all but the last
        token, whose KV is never computed): the next turn of a conversation, whose prompt starts
        with them, may arrive before the worker's KV events say so."""
        view = self.views.get(live.decode.worker_id)
        size = getattr(self.policy, "page_size", 0)
        if view is None or not size or len(output) < 2:
            return
        tokens = list(req.prompt_token_ids) + list(output[:-1])
        self.policy.remember(view, page_hashes(tokens, size, req.block_hashes), capacity(view))
