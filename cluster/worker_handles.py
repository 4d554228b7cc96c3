"""Worker handles over the in-process async fronts (`AsyncPrefillWorker`,
`AsyncDecodeWorker`): what the Ray actors host, and what in-process router tests use.

The decode handle also owns a stream's end: a request cancelled (or failed over) before
anyone read its stream still has outputs queued in the front, so cancel drains them.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from decode_worker.async_worker import AsyncDecodeWorker
from decode_worker.types import Admission, DecodeLoad, DecodeOutput
from engine.sampling_params import SamplingParams
from prefill_worker.async_worker import AsyncPrefillWorker
from prefill_worker.tasks import PrefillLoad, PrefillResult, PrefillTask


class LocalPrefillHandle:
    def __init__(self, front: AsyncPrefillWorker, worker_id: str, pool: str = "prefill") -> None:
        self.front, self.worker_id, self.pool = front, worker_id, pool

    async def submit(self, task: PrefillTask) -> PrefillResult:
        return await self.front.submit(task)

    async def cancel(self, request_id: str) -> bool:
        return await self.front.cancel(request_id)

    async def load(self) -> PrefillLoad:
        return await self.front.load()

    def close(self) -> None:
        self.front.close()


class LocalDecodeHandle:
    def __init__(self, front: AsyncDecodeWorker, worker_id: str, pool: str = "decode", role: str = "decode") -> None:
        self.front, self.worker_id, self.pool, self.role = front, worker_id, pool, role
        self._unread: set[str] = set()   # admitted, stream not opened yet
        self._drains: set[asyncio.Task] = set()

    async def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Admission:
        adm = await self.front.admit(request_id, prompt_token_ids, params)
        self._unread.add(request_id)
        return adm

    async def wait_admitted(self, request_id: str) -> Admission:
        return await self.front.wait_admitted(request_id)

    async def stream(self, request_id: str) -> AsyncIterator[DecodeOutput]:
        self._unread.discard(request_id)
        async for out in self.front.stream(request_id):
            yield out

    async def cancel(self, request_id: str) -> bool:
        found = await self.front.cancel(request_id)
        if request_id in self._unread:
            self._unread.discard(request_id)
            task = asyncio.get_running_loop().create_task(self._drain(request_id))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
        return found

    async def _drain(self, request_id: str) -> None:
        with contextlib.suppress(KeyError, asyncio.TimeoutError):
            async with asyncio.timeout(30):
                async for _ in self.front.stream(request_id):
                    pass

    async def load(self) -> DecodeLoad:
        return await self.front.load()

    def close(self) -> None:
        self.front.close()
