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
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from prefill_worker.tasks import PrefillLoad, PrefillResult, PrefillTask
from prefill_worker.worker import PrefillWorker

T = TypeVar("T")


class AsyncPrefillWorker:
    def __init__(self, worker: PrefillWorker, idle_s: float = 0.002) -> None:
        self.worker = worker
        self._idle_s = idle_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._results: dict[str, concurrent.futures.Future] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="prefill-worker-loop", daemon=True)
        self._thread.start()

    async def _run(self, fn: Callable[[], T]) -> T:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        return await asyncio.wrap_future(fut)

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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.worker.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = self.worker.has_work
            try:
                fn, fut = self._calls.get_nowait() if busy else self._calls.get(timeout=self._idle_s)
            except queue.Empty:
                fn = None
            if fn is not None:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except Exception as exc:
                        fut.set_exception(exc)
                continue
            if busy:
                for r in self.worker.step():
                    fut = self._results.pop(r.request_id, None)
                    if fut is not None:
                        fut.set_result(r)
