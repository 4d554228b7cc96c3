"""The Dispatcher's loads and health tracking (`WorkerHealth`, a mixin of router.dispatch's
`Dispatcher`): one load call kept pending per worker, each answer taken the moment it comes;
a worker out of placement (`replacing`, `dead`, `unresponsive`: fenced) and back in (its owed
cancels sent, warmed up, then `serving` or `spare`); hot spares promoted to keep each pool's
serving target. The rules are router.dispatch's module docstring ("Health", "Hot spares").

It relies on these attributes, set in `Dispatcher.__init__`: `views`, `handles`, `prefills`,
`decodes`, `spares`, `serving_target`, `worker_timeout_s`, `kv_index`, `_kv_sync`, `tier` (the
KV stores), `_back`, `_started`, `_load_calls`, `_answered`, `_warming`, `_silent_since` and `_retiring`; and on
`warm_up` (router.membership) to warm a worker that answers again.
"""
from __future__ import annotations

import asyncio
import logging
import time

from router.handles import WorkerUnresponsive
from router.pair_calls import WARM_UP_PROMPT, first_line as _first_line
from router.policy import WorkerView

_WATCHED = ("starting", "serving", "spare")  # the states that silence for worker_timeout_s ends

log = logging.getLogger("router.dispatch")  # the dispatcher's log, as before the split (and router.pair_calls)


class WorkerHealth:
    """The loads and health half of `Dispatcher` (router.dispatch): its state is Dispatcher's
    fields (views, handles, _load_calls, _answered, ...)."""

    async def refresh_loads(self, timeout_s: float = 2.0) -> None:
        """Keep one load call pending per worker and wait up to timeout_s for the answers of the
        workers in (or waiting for) placement; a call still pending then is left running (the
        worker is mid-step; see router.dispatch's module docstring). Answers are taken the moment they come
        (`_answer`), so a replaced or woken worker is warmed up without waiting for a refresh."""
        async def one(wid: str, handle) -> None:
            view = self.views.get(wid)
            if view is None or wid in self._retiring:  # removed (scale-in) since the refresh began, or leaving
                return
            lost = handle.take_lost()
            if lost is not None and view.state not in ("dead", "replacing"):  # its output stream failed
                self._out(view, "replacing", f"lost: {type(lost).__name__}: {_first_line(lost)}")
            call = self._load_calls.get(wid)
            if call is None:
                call = self._load_calls[wid] = asyncio.ensure_future(handle.load())
                call.add_done_callback(lambda c, wid=wid: self._answer(wid, c))
            if view.state not in _WATCHED:  # out of placement: nothing to judge, nothing to wait for
                return
            calls = (call,) if self._kv_sync is None else (call, self._kv_sync.pull(wid, handle))
            # judged the moment its worker_timeout_s runs out, whatever timeout_s is
            wait = min(timeout_s, max(self._heard(wid) + self.worker_timeout_s - time.monotonic(), 0.0) + 0.01)
            await asyncio.wait(calls, timeout=wait)
            if wid not in self.views:
                return
            silent = time.monotonic() - self._heard(wid)
            if not call.done() and silent >= self.worker_timeout_s and view.state in _WATCHED:
                self._unresponsive(wid, silent)

        await asyncio.gather(*(one(w, h) for w, h in {**self.prefills, **self.decodes}.items()),
                             *([self.tier.refresh(timeout_s)] if self.tier is not None else []))
        await asyncio.sleep(0)  # the done callbacks of calls that just completed

    def _answer(self, wid: str, call: asyncio.Future) -> None:
        """A worker's load call completed: its load, or why it is out of placement."""
        if self._load_calls.get(wid) is call:
            del self._load_calls[wid]
        if call.cancelled() or wid not in self.views:  # the router is stopping, or the worker was removed
            return
        view, exc = self.views[wid], call.exception()
        if wid in self._retiring or view.state == "warming":  # being added or removed: its state is the scaler's
            if exc is None:
                self._answered[wid] = time.monotonic()
                view.load = call.result()
                view.pid, view.node = view.load.pid, view.load.node
            return
        if exc is None:
            self._answered[wid] = time.monotonic()
            self._loaded(wid, view, call.result())
        elif isinstance(exc, Exception):  # the worker's process or actor is gone: out of placement
            # Ray says ActorUnavailableError while it restarts the worker's process, ActorDiedError
            # once it gave up; anything else (its engine loop died in a live process) is dead too
            state = "replacing" if type(exc).__name__ == "ActorUnavailableError" else "dead"
            self._out(view, state, f"{type(exc).__name__}: {_first_line(exc)}")

    def _heard(self, wid: str) -> float:
        """When the worker last showed life: a load answer or an output (or the router's start)."""
        return max(self._answered.get(wid, self._started), self.handles[wid].last_output, self._started)

    def _unresponsive(self, wid: str, silent: float) -> None:
        """It answered nothing for worker_timeout_s: out of placement, and every request open on
        it fails now (its streams migrate, its prefills move): router.handles fences it."""
        view = self.views[wid]
        why = (f"unresponsive: no load answer and no output for {silent:.1f} s "
               f"(worker_timeout_s={self.worker_timeout_s:g})")
        self._silent_since[wid] = self._heard(wid)
        self._out(view, "unresponsive", why)
        failed = self.handles[wid].fence(WorkerUnresponsive(f"worker {wid} {why}"))
        log.warning("worker %s is %s; %d request(s) open on it failed over", wid, why, failed)

    def _lost(self, wid: str, exc: BaseException) -> None:
        """Its output stream failed (its process is gone): out of placement at once."""
        view = self.views.get(wid)
        if view is None or wid in self._retiring:  # removed, or being removed: it stays out of placement
            return
        if view.state not in ("dead", "replacing"):
            self._out(view, "replacing", f"lost: {type(exc).__name__}: {_first_line(exc)}")

    def _out(self, view: WorkerView, state: str, error: str) -> None:
        was = view.state
        view.healthy, view.state, view.error, view.last_error = False, state, error[:300], error[:300]
        if self.kv_index is not None and view.worker_id in self.kv_index.workers:
            # a lost worker's cache went with its process; an unresponsive one's may have moved on
            (self.kv_index.degrade if state == "unresponsive" else self.kv_index.drop)(view.worker_id, error)
        if state == "dead":  # streams waiting for this worker's return give up
            self._wake()
        if was == "serving":
            self._promote(view.pool)

    def _serving_count(self, pool: str) -> int:
        return sum(1 for v in self.views.values() if v.pool == pool and v.state == "serving")

    def _promote(self, pool: str) -> None:
        """Spares of `pool` take the places of its workers out of placement, at once."""
        for v in self.views.values():
            if self._serving_count(pool) >= self.serving_target[pool]:
                return
            if v.pool == pool and v.state == "spare":
                self._serving(v)
                log.warning("spare %s of pool %s promoted to serving", v.worker_id, pool)

    def _fit(self, view: WorkerView) -> None:
        """A worker fit for placement serves if its pool is short of serving workers, else it
        stands by as a spare."""
        if self._serving_count(view.pool) >= self.serving_target[view.pool]:
            view.healthy, view.error, view.state = False, "", "spare"
        else:
            self._serving(view)

    def _wake(self) -> None:
        """Wake the streams waiting for a worker (_wait_for)."""
        self._back.set()
        self._back = asyncio.Event()

    def _loaded(self, wid: str, view: WorkerView, load) -> None:
        """A load answered. A worker answering from a new process (Ray restarted it) is warmed up
        (its KV transfer handshakes done) before it is placed on again."""
        view.load = load
        if view.pid and load.pid and load.pid != view.pid:
            view.restarts += 1
            if view.state != "replacing":
                self._out(view, "replacing", f"restarted: process {view.pid} -> {load.pid}")
        view.pid, view.node = load.pid, load.node
        if view.state in ("replacing", "dead", "unresponsive"):
            if view.state == "unresponsive":
                silent = time.monotonic() - self._silent_since.pop(wid, self._started)
                view.last_error = view.error = (f"unresponsive for {silent:.1f} s (no load answer, no output; "
                                                f"worker_timeout_s={self.worker_timeout_s:g}); warming up")
            view.state = "replacing" if view.state == "dead" else view.state
            if wid not in self._warming:
                task = asyncio.get_running_loop().create_task(self._rejoin(wid))
                self._warming[wid] = task
                task.add_done_callback(lambda t, wid=wid: self._warming.pop(wid, None))
            return
        if view.state == "starting":  # its first answer
            if wid in self.spares:
                view.healthy, view.state = False, "spare"
            else:
                self._fit(view)
        view.error = ""

    def _serving(self, view: WorkerView) -> None:
        view.healthy, view.error, view.state = True, "", "serving"
        self._wake()

    async def _rejoin(self, wid: str) -> None:
        """A worker answering again (a new process, or one that was unresponsive): the cancels it
        is owed first (their pages come back), then a warm-up through its pairs, then placement."""
        view = self.views[wid]
        t0 = time.monotonic()
        try:
            failed = await self.handles[wid].unfence()
            if failed:
                log.warning("worker %s: cancels of %d fenced request(s) failed: %s", wid, len(failed), failed[:4])
            await self.warm_up(WARM_UP_PROMPT, only=wid)
        except Exception as exc:
            view.failed_rejoins += 1
            # the first failure is retried by the next refresh at once; then a backoff
            wait = 0.0 if view.failed_rejoins == 1 else min(2.0 ** (view.failed_rejoins - 2), 30.0)
            view.error = view.last_error = (f"warm-up after a restart failed {view.failed_rejoins} time(s), next try in "
                                            f"{wait:g} s: {_first_line(exc)}")[:300]
            if view.state == "unresponsive":  # the same process: tried again as one that is being replaced
                view.state = "replacing"
            await asyncio.sleep(wait)
            return
        view.failed_rejoins = 0
        self._fit(view)
        log.warning("worker %s is back (%s) after a %.2f s warm-up (restart %d)", wid, view.state,
                    time.monotonic() - t0, view.restarts)
