"""The Dispatcher's membership (`Membership`, a mixin of router.dispatch's `Dispatcher`):
warming every (prefill, decode) pair up before the router serves; taking a worker into
placement at run time (`add_worker`), draining one for removal (`retire_worker`: its streams
finish, or move with identical tokens after the grace) and forgetting it (`remove_worker`);
the cancels of requests ended early (`_abort_later`) and the cleanup when the router stops
(`drain_cleanup`). cluster.runtime's scaler drives the run-time calls (cluster.actors).

It relies on these attributes, set in `Dispatcher.__init__`: `views`, `handles`, `prefills`,
`decodes`, `spares`, `serving_target`, `_kv_sync`, `tier`, `_cleanup`, `_load_calls`, `_answered`,
`_warming`, `_silent_since` and `_retiring`; on `_abort` (router.dispatch: the cancel of a
request on both its workers); and on `_lost`, `_serving` and `_wake` (router.worker_health).
"""
from __future__ import annotations

import asyncio
import logging
import time

from engine.sampling_params import SamplingParams
from router.handles import WorkerHandle, WorkerUnresponsive
from router.pair_calls import WARM_UP_PROMPT, first_line as _first_line, warm_pair
from router.policy import WorkerView

log = logging.getLogger("router.dispatch")  # the dispatcher's log, as before the split (and router.pair_calls)


class Membership:
    """The membership half of `Dispatcher` (router.dispatch): its state is Dispatcher's fields
    (views, handles, serving_target, _retiring, ...)."""

    # ---- start-up ---------------------------------------------------------------------------
    async def warm_up(self, prompt_token_ids: list[int], timeout_s: float = 120.0, only: str | None = None) -> int:
        """One greedy one-token request through every (prefill, decode) pair, so each pair's
        transfer handshake (connection, compatibility check) is done before the router says
        SERVING. Pairs run one after another (start-up is not latency-critical and a shared CPU
        gains nothing from overlap). Colocated workers prefill locally and take no transfers, so
        they are skipped. Raises RuntimeError naming the pair that failed; returns the number
        of pairs warmed."""
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        def partner_ok(h: WorkerHandle) -> bool:  # warming one worker: with the partners fit for placement
            return h.worker_id == only or self.views[h.worker_id].state in ("serving", "spare")

        pairs = [(p, d) for p in self.prefills.values() for d in self.decodes.values() if d.role == "decode"
                 and (only is None or (only in (p.worker_id, d.worker_id) and partner_ok(p) and partner_ok(d)))]
        for prefill, decode in pairs:
            rid = f"warm-up:{decode.channel}:{prefill.worker_id}->{decode.worker_id}"  # unique per router
            try:
                await asyncio.wait_for(self._warm_pair(prefill, decode, rid, prompt_token_ids, params), timeout_s)
            except BaseException as exc:
                await self._abort(decode, prefill, rid)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise RuntimeError(f"warm-up of {prefill.worker_id} -> {decode.worker_id} failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
        return len(pairs)

    _warm_pair = staticmethod(warm_pair)

    # ---- resizing pools at run time (cluster.runtime's scaler drives these) -------------------
    async def add_worker(self, handle: WorkerHandle, timeout_s: float = 120.0) -> float:
        """Take a new worker into placement: state `warming` (out of placement) while its first
        load answers and one request runs through each of its pairs (a decode worker with every
        serving prefill worker, a prefill worker with every serving decode worker, a colocated
        worker by itself), then `serving`, the pool's serving target one larger. Returns the
        seconds the warm-up took; raises (the worker stays out of placement) when it fails."""
        wid = handle.worker_id
        if wid in self.views:
            raise ValueError(f"worker {wid} is already known to this router")
        view = WorkerView(wid, handle.pool, handle.role, healthy=False, state="warming")
        self.views[wid] = view
        self.handles[wid] = handle
        (self.prefills if handle.role == "prefill" else self.decodes)[wid] = handle
        handle.on_lost = lambda exc, wid=wid: self._lost(wid, exc)
        self.serving_target.setdefault(handle.pool, 0)
        t0 = time.monotonic()
        try:
            view.load = await asyncio.wait_for(handle.load(), timeout_s)
            view.pid, view.node = view.load.pid, view.load.node
            self._answered[wid] = time.monotonic()
            if handle.role == "colocated":
                rid = f"warm-up:{handle.channel}:{wid}"
                params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
                try:
                    await asyncio.wait_for(self._warm_pair(None, handle, rid, WARM_UP_PROMPT, params), timeout_s)
                except BaseException:
                    await self._abort(handle, None, rid)
                    raise
            else:
                await self.warm_up(WARM_UP_PROMPT, timeout_s, only=wid)
        except BaseException as exc:
            view.error = view.last_error = f"warm-up failed: {type(exc).__name__}: {_first_line(exc)}"[:300]
            raise
        self.serving_target[handle.pool] += 1
        self._serving(view)
        took = time.monotonic() - t0
        log.warning("worker %s of pool %s added: serving after a %.2f s warm-up", wid, handle.pool, took)
        return took

    async def retire_worker(self, wid: str, grace_s: float = 30.0) -> dict:
        """Drain a worker for removal: out of placement at once (state `draining`, the pool's
        serving target one smaller, no spare promoted for it); its requests from this router
        finish within `grace_s`; the decode streams still open then move to other decode
        workers as a lost worker's do (same Resume path: identical tokens) and prefills still
        running are retried elsewhere; their cancels go to the worker, so its pages come back.
        Returns {"finished", "moved", "seconds"}. The worker stays known (state `draining`)
        until `remove_worker`."""
        view, handle = self.views[wid], self.handles[wid]
        t0 = time.monotonic()
        if wid not in self._retiring:
            self._retiring.add(wid)
            if view.state in ("serving", "warming") and self.serving_target.get(view.pool, 0) > 0 \
                    and wid not in self.spares:
                self.serving_target[view.pool] -= 1
            view.healthy, view.state, view.error = False, "draining", "draining: being removed from its pool"
        before = view.inflight
        deadline = t0 + grace_s
        while view.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        moved = 0
        if view.inflight > 0:  # the grace ran out: move them (a deliberate loss; owed cancels free the pages)
            moved = handle.fence(WorkerUnresponsive(f"worker {wid} is being removed (scale-in): its grace of "
                                                    f"{grace_s:g} s ran out"))
            log.warning("worker %s: %d request(s) still open after the %.1f s grace moved to other workers",
                        wid, moved, grace_s)
            end = time.monotonic() + 30
            while view.inflight > 0 and time.monotonic() < end:
                await asyncio.sleep(0.02)
            failed = await handle.unfence()
            if failed:
                log.warning("worker %s: cancels of %d moved request(s) failed: %s", wid, len(failed), failed[:4])
        return {"finished": max(before - moved, 0), "moved": moved, "seconds": time.monotonic() - t0}

    async def remove_worker(self, wid: str) -> None:
        """Forget a drained worker (retire_worker first): it is no longer watched or placed on."""
        handle = self.handles.pop(wid, None)
        if handle is None:
            return
        self.prefills.pop(wid, None)
        self.decodes.pop(wid, None)
        self.views.pop(wid, None)
        self._retiring.discard(wid)
        self._answered.pop(wid, None)
        self._silent_since.pop(wid, None)
        call = self._load_calls.pop(wid, None)
        if call is not None:
            call.cancel()
        warming = self._warming.pop(wid, None)
        if warming is not None:
            warming.cancel()
        handle.on_lost = None
        if self._kv_sync is not None:
            self._kv_sync.forget(wid)
        await handle.close()
        self._wake()

    # ---- cleanup --------------------------------------------------------------------------
    def _abort_later(self, live) -> None:  # live: router.dispatch._Live
        # The caller's task is being cancelled (client cancel, deadline): the cancels run in a
        # task of their own so they finish whatever happens to the caller.
        task = asyncio.get_running_loop().create_task(self._abort(live.decode, live.prefill, live.worker_rid))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def drain_cleanup(self) -> None:
        """Finish pending cancels, drop pending load calls and stop reading the workers' output
        streams (the router is stopping)."""
        if self._cleanup:
            await asyncio.gather(*list(self._cleanup), return_exceptions=True)
        calls, self._load_calls = list(self._load_calls.values()), {}
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        if self.tier is not None:
            await self.tier.close()
        if self._kv_sync is not None:
            await self._kv_sync.close()
        await asyncio.gather(*(h.close() for h in {**self.prefills, **self.decodes}.values()), return_exceptions=True)
