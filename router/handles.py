"""`WorkerHandle`: the router's side of one worker, wherever the worker runs. Between the
dispatcher and the worker's engine there are two objects: this handle, and the `AsyncWorker`
that hosts the worker (engine/async_worker.py), in this process or as a Ray actor.

The handle reaches the host through a `Remote`: `InProcess` here calls its coroutines directly;
`cluster.runtime.RayActor` makes the same calls as Ray actor calls. It opens each request on
one channel of its own and reads the channel's outputs as one stream (one item per engine step
for all of its requests), sorting them into per-request queues. If that stream fails (the
worker's process is gone), every open request gets the error, as the dispatcher expects of a
lost worker.

A decode request through a handle: admit -> an Admission (QUEUED_FOR_PAGES is followed by a
second Admission once pages are free) -> DecodeOutputs until one is `finished`. A prefill
request: submit -> its PrefillResult. cancel() at any point ends the request on the worker.

Fencing: when the router gives up on a worker that answers nothing (router.dispatch), `fence`
fails every request open on the handle at once (its admits, submits and streams raise, as for a
lost worker) and drops their queues, so nothing the worker sends later for them reaches anyone;
the requests are owed a cancel, sent by `unfence` once the worker answers again, which frees
their pages before it is placed on again.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from decode_worker.types import Admission, DecodeOutput
from engine.kv_events import KVEventBatch
from engine.load import WorkerLoad
from engine.outputs import RemotePrefix, Resume
from engine.sampling_params import SamplingParams
from prefill_worker.types import PrefillResult, PrefillTask


class Remote(Protocol):
    """Calls on a worker's `AsyncWorker`: a method's result, or a streaming method's items."""

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...
    def stream(self, method: str, *args: Any) -> AsyncIterator[Any]: ...


class InProcess:
    """An `AsyncWorker` in this process (tests, benchmarks, single-process tools)."""

    def __init__(self, host: Any) -> None:
        self.host = host

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.host, method)(*args, **kwargs)

    async def stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        async for item in getattr(self.host, method)(*args):
            yield item


class WorkerUnresponsive(RuntimeError):
    """The router gave up on the worker (it answered nothing for worker_timeout_s): its open
    requests fail with this, as for a lost worker."""


class WorkerHandle:
    def __init__(self, remote: Remote, worker_id: str, pool: str, role: str, channel_prefix: str = "") -> None:
        """`channel_prefix`: the router's identity and incarnation ("router-0/3f2a9c1b"); its
        channel on the worker is then `<prefix>-<worker_id>`, which a later incarnation of the
        same router can retire (engine.async_worker.AsyncWorker.retire)."""
        self.remote, self.worker_id, self.pool, self.role = remote, worker_id, pool, role
        self.channel = f"{channel_prefix}-{worker_id}" if channel_prefix else f"{worker_id}-{uuid.uuid4().hex[:12]}"
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._lost: BaseException | None = None  # why the output stream last failed (the worker was lost)
        self.losses = 0  # how many times the output stream failed or the handle was fenced: a request admitted before is gone
        self.last_output = 0.0  # time.monotonic() of the last item from the worker's output stream
        self.on_lost: Callable[[BaseException], None] | None = None  # told at once when the output stream fails
        self._fenced: BaseException | None = None  # why the router gave up on the worker, until unfence()
        self._fence_waiter: asyncio.Future | None = None  # done when fence() runs: wakes calls still pending
        self.owed_cancels: set[str] = set()  # requests failed by fence(), to cancel when the worker answers

    # ---- decode (and colocated) workers ---------------------------------------------------
    async def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    resume: Resume | None = None, remote_prefix: RemotePrefix | None = None) -> Admission:
        """`resume`: the request continues a stream whose decode worker was lost (engine.request.Resume).
        `remote_prefix`: the worker prefills the request itself after fetching its first pages
        (the Admission's `prefix_fetch` goes to their holder)."""
        if remote_prefix is None:
            return await self._open(request_id, "admit", request_id, prompt_token_ids, params, resume)
        return await self._open(request_id, "admit", request_id, prompt_token_ids, params, resume, remote_prefix)

    async def next_output(self, request_id: str) -> Admission | DecodeOutput:
        """The request's next output (after a QUEUED_FOR_PAGES admission: its Admission with
        pages, or a finished output if it ended first)."""
        q = self._queues.get(request_id)
        if q is None:  # fenced (or cancelled) since it was opened
            raise self._fenced or KeyError(f"request {request_id} is not open on worker {self.worker_id}")
        out = await q.get()
        if isinstance(out, BaseException):
            raise out
        if out.finished:
            self._queues.pop(request_id, None)
        return out

    async def stream(self, request_id: str) -> AsyncIterator[DecodeOutput]:
        """The request's outputs until its finished one."""
        try:
            while True:
                out = await self.next_output(request_id)
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(request_id, None)

    # ---- prefill workers ------------------------------------------------------------------
    async def submit(self, task: PrefillTask, on_fetch: Callable[[Any], Awaitable[None]] | None = None
                     ) -> PrefillResult:
        """Prefill a request; returns once its first token is sampled (or it failed). With
        `task.remote_prefix` the worker answers where a holder is to send the prefix (an
        engine.outputs.PrefixFetch, or None when it has nothing to fetch): `on_fetch(fetch)` is
        awaited then (the router has the holder send it, or the worker compute it all)."""
        fetch = await self._open(task.request_id, "submit", task)
        if fetch is not None and on_fetch is not None:
            await on_fetch(fetch)
        return await self.next_output(task.request_id)

    # ---- a prefix fetch's other calls (any role) ------------------------------------------
    async def export_prefix(self, fetch: Any, prompt_token_ids: list[int]) -> Any:
        """As the holder: pin the cached pages `fetch` asks for and send them (engine.outputs.PrefixExport)."""
        return await self.remote.call("call", "export_prefix", fetch, prompt_token_ids)

    async def abandon_fetch(self, request_id: str) -> bool:
        """As the requester: compute the whole prompt instead (the holder sends nothing)."""
        return await self.remote.call("call", "abandon_fetch", request_id)

    # ---- any worker -----------------------------------------------------------------------
    async def cancel(self, request_id: str) -> bool:
        self._queues.pop(request_id, None)  # whatever still comes for it is dropped
        if self._fenced is not None:  # it answers nothing: the cancel is sent by unfence()
            self.owed_cancels.add(request_id)
            raise self._fenced
        return await self.remote.call("call", "cancel", request_id)

    @property
    def fenced(self) -> bool:
        return self._fenced is not None

    def fence(self, exc: BaseException) -> int:
        """Fail every request open on this handle with `exc` now, calls still pending included,
        and drop their queues (the worker's later outputs for them are ignored); until
        `unfence`, new calls fail too and cancels are owed. Returns how many requests failed."""
        self._fenced = exc
        self.losses += 1
        rids = list(self._queues)
        self.owed_cancels.update(rids)
        for q in self._queues.values():
            q.put_nowait(exc)
        self._queues.clear()
        if self._fence_waiter is not None and not self._fence_waiter.done():
            self._fence_waiter.set_result(None)
        return len(rids)

    async def unfence(self, timeout_s: float = 10.0) -> list[str]:
        """The worker answers again: cancel what fence() failed (so its pages come back), then
        accept calls. Returns the request ids whose cancel failed."""
        self._fenced, self._fence_waiter = None, None
        owed, self.owed_cancels = sorted(self.owed_cancels), set()
        failed = []
        for rid in owed:
            try:
                await asyncio.wait_for(self.remote.call("call", "cancel", rid), timeout_s)
            except Exception:
                failed.append(rid)
        return failed

    async def load(self) -> WorkerLoad:
        return await self.remote.call("load")

    async def kv_events(self, epoch: str, since: int) -> KVEventBatch:
        """The worker's prefix-cache events after `since` of `epoch`, or a snapshot (engine.kv_events)."""
        return await self.remote.call("call", "kv_events", epoch, since)

    def take_lost(self) -> BaseException | None:
        """Why the worker's output stream failed since the last call (its process was lost), or None."""
        lost, self._lost = self._lost, None
        return lost

    async def _open(self, request_id: str, method: str, *args: Any) -> Any:
        """Call `method(*args)` on the worker, opening `request_id`'s outputs on this handle."""
        if self._fenced is not None:
            raise self._fenced
        self._queues[request_id] = asyncio.Queue()
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        if self._fence_waiter is None:
            self._fence_waiter = asyncio.get_running_loop().create_future()
        fence = self._fence_waiter
        call = asyncio.ensure_future(self.remote.call("call", method, *args, channel=self.channel))
        try:
            await asyncio.wait((call, fence), return_when=asyncio.FIRST_COMPLETED)
            if not call.done():  # fenced while the worker had not answered: the cancel is owed
                call.add_done_callback(_ignore)
                raise self._fenced or WorkerUnresponsive(f"worker {self.worker_id} was fenced")
            return call.result()
        except BaseException:
            if not call.done():
                call.cancel()
            self._queues.pop(request_id, None)
            raise

    async def _read(self) -> None:
        try:
            async for outs in self.remote.stream("outputs", self.channel):
                self.last_output = time.monotonic()
                for out in outs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
            raise RuntimeError(f"worker {self.worker_id}'s output stream ended")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._lost = exc
            self.losses += 1
            for q in list(self._queues.values()):
                q.put_nowait(exc)
            if self.on_lost is not None:
                self.on_lost(exc)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


def _ignore(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a fenced call's late answer or error is of no interest
