"""`AsyncPrefillWorker`: the asyncio front of a PrefillWorker. A background loop thread owns
the worker (engine objects are single-threaded), runs the calls coroutines hand it, and steps
the worker while it has work; `submit` resolves with the request's first token (TTFT) while
its KV may still be moving.

    front = AsyncPrefillWorker(PrefillWorker(model, transport="nixl"))
    result = await front.submit(PrefillTask(rid, prompt_ids, params, [descriptor]))
"""
from __future__ import annotations

import asyncio
import concurrent.futures

from engine.loop_thread import EngineLoopThread
from prefill_worker.tasks import PrefillLoad, PrefillResult, PrefillTask
from prefill_worker.worker import PrefillWorker


class AsyncPrefillWorker(EngineLoopThread):
    def __init__(self, worker: PrefillWorker, idle_s: float = 0.002) -> None:
        self._results: dict[str, concurrent.futures.Future] = {}
        super().__init__(worker, "prefill-worker-loop", idle_s)

    async def submit(self, task: PrefillTask) -> PrefillResult:
        result: concurrent.futures.Future = concurrent.futures.Future()

        def go() -> None:
            self.worker.submit(task)
            self._results[task.request_id] = result

        await self._run(go)
        return await asyncio.wrap_future(result)

    async def cancel(self, request_id: str) -> bool:
        def go() -> bool:
            fut = self._results.pop(request_id, None)
            if fut is not None:
                fut.set_result(PrefillResult(request_id, None, 0, ok=False, error="cancelled"))
            return self.worker.cancel(request_id)

        return await self._run(go)

    async def load(self) -> PrefillLoad:
        return await self._run(self.worker.load)

    def _on_step(self, results: list[PrefillResult]) -> None:
        for r in results:
            fut = self._results.pop(r.request_id, None)
            if fut is not None:
                fut.set_result(r)
