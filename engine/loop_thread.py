"""`EngineLoopThread`: drive a single-threaded worker (anything with `has_work`, `step()` and
`close()`, built on an EngineCore) from asyncio. One daemon thread owns the worker: it runs
the calls coroutines hand it (`await self._run(fn)`), steps the worker while it has work, and
passes each step's result to `_on_step`, which subclasses use to resolve futures or feed
per-request streams. Coroutines never touch the worker, so a model step never blocks the
event loop.

Without work the thread waits on its call queue: `idle_s` while the worker still has requests
open (work can appear without a call, e.g. KV arriving from a transfer thread), and `parked_s`
when it has none (only a call can bring work then, and a call ends the wait at once). An idle
worker thus wakes 10 times a second instead of 500, which matters on a small shared CPU.

The thread applies the process's intra-op thread count (`torch.set_num_threads`) to itself
before its first step. OpenMP keeps that count per thread, and a new thread starts from the
default (every core): torch's own parallel loops re-apply the setting lazily, but a library that
calls OpenMP directly does not. oneDNN's matmuls did not (tried for small decode batches, since
reverted): in one-thread workers they ran on two OpenMP threads on the 2-core VM, spinning on the
core the other worker needed.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class EngineLoopThread:
    def __init__(self, worker: Any, name: str, idle_s: float = 0.002, parked_s: float = 0.1) -> None:
        """Subclasses set up the state `_on_step` uses before calling this: the thread starts here.
        A worker without a `has_requests` attribute is never parked."""
        self.worker = worker
        self._idle_s, self._parked_s = idle_s, parked_s
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
        self._calls.put((lambda: None, concurrent.futures.Future()))  # end a parked wait now
        self._thread.join(timeout=10)
        self.worker.close()

    def _on_step(self, result: Any) -> None:
        """Handle what one `worker.step()` returned (on the loop thread)."""

    def _loop(self) -> None:
        torch.set_num_threads(torch.get_num_threads())  # OpenMP's count is per thread (see above)
        while not self._stop.is_set():
            try:
                if self.worker.has_work:
                    fn, fut = self._calls.get_nowait()
                else:
                    open_requests = getattr(self.worker, "has_requests", True)
                    fn, fut = self._calls.get(timeout=self._idle_s if open_requests else self._parked_s)
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
