"""Worker handles over Ray actor handles (`cluster.actors`): the router's side of a worker
in another process. A dead actor surfaces as an exception from the call, which the
dispatcher treats as a worker failure (retry before the first token, UNAVAILABLE after)."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator


class RayPrefillHandle:
    def __init__(self, actor, worker_id: str, pool: str) -> None:
        self.actor, self.worker_id, self.pool = actor, worker_id, pool

    async def submit(self, task):
        return await self.actor.submit.remote(task)

    async def cancel(self, request_id: str) -> bool:
        return await self.actor.cancel.remote(request_id)

    async def load(self):
        return await self.actor.load.remote()


class RayDecodeHandle:
    """The router's side of a decode actor. Outputs of every request this handle admitted come
    back on one Ray stream (`DecodeActor.outputs`, a list per step) and are sorted here into
    each request's queue; `stream(rid)` reads that queue. If the Ray stream fails (the actor
    died), every open request gets the error, as a per-request stream would have raised it."""

    def __init__(self, actor, worker_id: str, pool: str, role: str = "decode") -> None:
        self.actor, self.worker_id, self.pool, self.role = actor, worker_id, pool, role
        self.channel = f"{worker_id}-{uuid.uuid4().hex[:12]}"
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def admit(self, request_id, prompt_token_ids, params):
        self._queues[request_id] = asyncio.Queue()
        self._ensure_reader()
        try:
            return await self.actor.admit.remote(request_id, prompt_token_ids, params, self.channel)
        except BaseException:
            self._queues.pop(request_id, None)
            raise

    async def wait_admitted(self, request_id):
        return await self.actor.wait_admitted.remote(request_id)

    async def stream(self, request_id) -> AsyncIterator:
        q = self._queues[request_id]
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(request_id, None)

    async def cancel(self, request_id: str) -> bool:
        self._queues.pop(request_id, None)  # whatever still comes for it is dropped
        return await self.actor.cancel.remote(request_id)

    async def load(self):
        return await self.actor.load.remote()

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            async for ref in self.actor.outputs.options(num_returns="streaming").remote(self.channel):
                for out in await ref:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
            raise RuntimeError(f"decode worker {self.worker_id}'s output stream ended")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            for q in list(self._queues.values()):
                q.put_nowait(exc)
