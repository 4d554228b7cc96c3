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
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from decode_worker.types import Admission, DecodeOutput
from engine.load import WorkerLoad
from engine.outputs import Resume
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
        self.losses = 0  # how many times the output stream failed: a request admitted before a loss is gone

    # ---- decode (and colocated) workers ---------------------------------------------------
    async def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    resume: Resume | None = None) -> Admission:
        """`resume`: the request continues a stream whose decode worker was lost (engine.request.Resume)."""
        return await self._open(request_id, "admit", request_id, prompt_token_ids, params, resume)

    async def next_output(self, request_id: str) -> Admission | DecodeOutput:
        """The request's next output (after a QUEUED_FOR_PAGES admission: its Admission with
        pages, or a finished output if it ended first)."""
        out = await self._queues[request_id].get()
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
    async def submit(self, task: PrefillTask) -> PrefillResult:
        """Prefill a request; returns once its first token is sampled (or it failed)."""
        await self._open(task.request_id, "submit", task)
        return await self.next_output(task.request_id)

    # ---- any worker -----------------------------------------------------------------------
    async def cancel(self, request_id: str) -> bool:
        self._queues.pop(request_id, None)  # whatever still comes for it is dropped
        return await self.remote.call("call", "cancel", request_id)

    async def load(self) -> WorkerLoad:
        return await self.remote.call("load")

    def take_lost(self) -> BaseException | None:
        """Why the worker's output stream failed since the last call (its process was lost), or None."""
        lost, self._lost = self._lost, None
        return lost

    async def _open(self, request_id: str, method: str, *args: Any) -> Any:
        """Call `method(*args)` on the worker, opening `request_id`'s outputs on this handle."""
        self._queues[request_id] = asyncio.Queue()
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        try:
            return await self.remote.call("call", method, *args, channel=self.channel)
        except BaseException:
            self._queues.pop(request_id, None)
            raise

    async def _read(self) -> None:
        try:
            async for outs in self.remote.stream("outputs", self.channel):
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

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
