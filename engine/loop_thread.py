"""`EngineLoopThread`: drive a single-threaded worker (anything with `has_work`, `step()` and
`close()`, built on an EngineCore) from asyncio. One daemon thread owns the worker: it runs
the calls coroutines hand it (`await self._run(fn)`), steps the worker while it has work, and
passes each step's result to `_on_step`, which subclasses use to resolve futures or feed
per-request streams. Coroutines never touch the worker, so a model step never blocks the
event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class EngineLoopThread:
    def __init__(self, worker: Any, name: str, idle_s: float = 0.002) -> None:
        """Subclasses set up the state `_on_step` uses before calling this: the thread starts here."""
        self.worker = worker
        self._idle_s = idle_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    async def _run(self, fn: Callable[[], T]) -> T:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        return await asyncio.wrap_future(fut)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.worker.close()

    def _on_step(self, result: Any) -> None:
        """Handle what one `worker.step()` returned (on the loop thread)."""

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                fn, fut = self._calls.get_nowait() if self.worker.has_work else self._calls.get(timeout=self._idle_s)
            except queue.Empty:
                fn = None
            if fn is not None:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except Exception as exc:
                        fut.set_exception(exc)
                continue
            if self.worker.has_work:
                self._on_step(self.worker.step())
