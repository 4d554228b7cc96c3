"""`AsyncWorker`: the asyncio face of one worker (prefill, decode or colocated). A Ray actor is
this class itself (`ray.remote(AsyncWorker)`, cluster/), and an in-process router calls it
directly; either way the router reaches it through one generic mechanism (router/handles.py).

    host = AsyncWorker(lambda: DecodeWorker(model, transport="nixl"))
    adm = await host.call("admit", rid, prompt_ids, params, channel="router-1")
    async for outputs in host.outputs("router-1"): ...      # lists, one per engine step

`call(method, *args)` runs `worker.<method>(*args)` on the engine thread (engine/loop.py) for
the methods the worker lists in `CALLS`. A call that names a `channel` opens a request (its
first argument, or the request id of a task, is the request id): every output of that request
from then on goes to the channel's queue, in step order, until its final output (`finished`).
`outputs(channel)` yields what is queued, a step's worth at a time: one queue per channel, one
item per step for all of a channel's requests.

Every request a worker accepts ends with exactly one finished output (done, failed or
aborted), so a channel's routes never outlive their requests.

A router names its channels `<router>/<incarnation>-<worker>` ("router-0/3f2a9c1b-decode-0").
A router that comes back after its process was lost calls `retire(router, incarnation)` on
every worker: the requests its predecessors opened there are cancelled (their pages freed),
their channels dropped, and a late call from a predecessor is refused.

This module and engine/loop.py import no torch: unpickling a Ray handle of this actor class
imports them, in the router's process too.
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

from engine.heap import freeze_startup_heap, gc_pauses
from engine.load import WorkerLoad
from engine.loop import EngineLoop


class AsyncWorker:
    def __init__(self, worker: Any, name: str = "worker", exit_on_death: bool = False) -> None:
        """`worker`: a worker object, or a callable that builds one in this process (what a
        Ray actor is given: the worker's own process must create its engine). With
        `exit_on_death` (a Ray actor's), a dead engine loop ends the process once its open
        requests have been told, so that Ray restarts the worker."""
        self.exit_on_death = exit_on_death
        gc_pauses()  # time this process's garbage collections from the start
        self.node = getattr(worker, "node", "")  # a factory may know its node's address
        self.worker = worker if hasattr(worker, "step") else worker()
        self.calls = frozenset(self.worker.CALLS)
        self._routes: dict[str, str] = {}  # request id -> channel, until its finished output
        self._channels: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._incarnations: dict[str, str] = {}  # router -> its current incarnation (retire)
        self.engine = EngineLoop(self.worker, f"{name}-engine", self._on_step, self._on_death)

    # ---- what callers use -----------------------------------------------------------------
    async def call(self, method: str, *args, channel: str | None = None) -> Any:
        if method not in self.calls:
            raise ValueError(f"method must be one of {sorted(self.calls)}, got {method!r}")
        fn = getattr(self.worker, method)
        if channel is None:
            return await self.engine.run(lambda: fn(*args))
        rid = _request_id(args[0])
        self._bind_loop()
        with self._lock:
            if _retired(channel, self._incarnations):
                raise RuntimeError(f"channel {channel!r} belongs to a retired router incarnation")
            self._queue(channel)
            self._routes[rid] = channel
        try:
            return await self.engine.run(lambda: fn(*args))
        except BaseException:
            with self._lock:
                if self._routes.get(rid) == channel:
                    del self._routes[rid]
            raise

    async def outputs(self, channel: str) -> AsyncIterator[list]:
        """Every output of the requests opened on `channel`, in lists of what is ready. Raises
        once the engine loop has died: the caller's open requests end with that error."""
        self._bind_loop()
        q = self._queue(channel)
        while True:
            item = await q.get() if self._dead is None else self._dead
            if item is _RETIRED:
                return
            if isinstance(item, BaseException):
                raise RuntimeError(f"the worker's engine loop died: {type(item).__name__}: {item}")
            batch = list(item)
            while not q.empty():
                more = q.get_nowait()
                if isinstance(more, BaseException) or more is _RETIRED:  # after this batch: what came before it first
                    q.put_nowait(more)
                    break
                batch += more
            yield batch

    async def retire(self, router: str, incarnation: str) -> int:
        """`router` (its channels `<router>/<incarnation>-...`) now runs as `incarnation`: cancel
        every request open on the router's channels of any other incarnation, drop those
        channels (their output streams end) and refuse new requests on them. Returns how many
        requests were cancelled."""
        self._bind_loop()
        with self._lock:
            self._incarnations[router] = incarnation
            stale = [rid for rid, ch in self._routes.items() if _retired(ch, self._incarnations)]
            for rid in stale:  # their final "abort" outputs go nowhere
                del self._routes[rid]
            channels = [ch for ch in self._channels if _retired(ch, self._incarnations)]
        for ch in channels:
            self._channels.pop(ch).put_nowait(_RETIRED)
        if stale:
            cancel = self.worker.cancel
            await self.engine.run(lambda: [cancel(rid) for rid in stale])
        return len(stale)

    async def load(self) -> WorkerLoad:
        load = await self.engine.run(self.worker.load)
        load.gc, load.pid, load.node = gc_pauses().stats(), os.getpid(), self.node
        return load

    async def ready(self) -> int:
        """Answers once the engine thread runs; freezes the startup heap (engine/heap.py)."""
        await self.load()
        freeze_startup_heap()
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.engine.close()

    # ---- the engine thread ----------------------------------------------------------------
    def _on_step(self, outputs: list) -> None:
        if not outputs:
            return
        by_channel: dict[str, list] = {}
        with self._lock:
            for out in outputs:
                channel = self._routes.get(out.request_id)
                if channel is None:
                    continue
                if out.finished:
                    del self._routes[out.request_id]
                by_channel.setdefault(channel, []).append(out)
        if by_channel and self._loop is not None:
            # One wake-up of the event loop per step, not one per output.
            self._loop.call_soon_threadsafe(self._deliver, by_channel)

    def _on_death(self, exc: BaseException) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_channels, exc)
        else:
            self._dead = exc

    def _fail_channels(self, exc: BaseException) -> None:
        self._dead = exc
        for q in self._channels.values():
            q.put_nowait(exc)
        if self.exit_on_death:  # let the output streams carry the error out first
            self._loop.call_later(1.0, os._exit, 70)

    def _deliver(self, by_channel: dict[str, list]) -> None:
        for channel, outs in by_channel.items():
            if not _retired(channel, self._incarnations):
                self._queue(channel).put_nowait(outs)

    def _queue(self, channel: str) -> asyncio.Queue:
        q = self._channels.get(channel)
        if q is None:
            q = self._channels[channel] = asyncio.Queue()
        return q

    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()


_RETIRED = object()  # ends a retired channel's output stream


def _retired(channel: str, incarnations: dict[str, str]) -> bool:
    """Whether `channel` belongs to an older incarnation of a router that has come back."""
    router, sep, rest = channel.partition("/")
    current = incarnations.get(router) if sep else None
    return current is not None and not rest.startswith(current + "-")


def _request_id(first_arg: Any) -> str:
    return first_arg if isinstance(first_arg, str) else first_arg.request_id
