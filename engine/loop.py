"""`EngineLoop`: the thread that owns a worker built on an EngineCore (a prefill, decode or
colocated worker: anything with `core`, `has_work`, `step()` and `close()`). It runs the calls
other threads hand it, steps the worker while it has work, and hands each step's outputs to
`on_step`. Engine objects are single-threaded: nothing else touches the worker.

Without work the thread sleeps on its call queue until a call comes or `wake()` is called; the
engine's KV connector calls `wake()` when a transfer arrives, completes or fails. Nothing polls:
an idle worker costs no CPU, and an event is handled the moment it happens.

The thread applies the process's intra-op thread count (`torch.set_num_threads`) to itself
before its first step. OpenMP keeps that count per thread, and a new thread starts from the
default (every core): torch's own parallel loops re-apply the setting lazily, but a library that
calls OpenMP directly does not. oneDNN's matmuls did not: in one-thread workers they ran on two
OpenMP threads on a 2-core VM, spinning on the core the other worker needed.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_WAKE = object()


class EngineLoop:
    def __init__(self, worker: Any, name: str, on_step: Callable[[Any], None] = lambda result: None,
                 on_death: Callable[[BaseException], None] = lambda exc: None) -> None:
        self.worker = worker
        self._on_step = on_step
        self._on_death = on_death
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.num_steps = 0  # steps run: an idle worker runs none
        self.error: BaseException | None = None  # what ended the loop, if anything did
        worker.core.set_wakeup(self.wake)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread, between steps. Once the loop has died, the future
        fails at once with the reason."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        if self.error is not None:  # after the put: the dying loop may have drained before it
            self._fail_pending()
        return fut

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    def wake(self) -> None:
        """Something outside a call made work (callable from any thread)."""
        self._calls.put(_WAKE)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self.wake()
        self._thread.join(timeout=10)
        self.worker.close()

    def _loop(self) -> None:
        try:
            self._run_loop()
        except BaseException as exc:  # a step's own errors end only its requests (EngineCore.step)
            log.exception("%s: the engine loop died; the worker is out of service", self._thread.name)
            self.error = exc
            self._fail_pending()
            self._on_death(exc)

    def _fail_pending(self) -> None:
        reason = RuntimeError(f"the engine loop died: {type(self.error).__name__}: {self.error}")
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not _WAKE and item[1].set_running_or_notify_cancel():
                item[1].set_exception(reason)

    def _run_loop(self) -> None:
        import torch  # here, not at the top: a Ray actor handle of AsyncWorker imports this module
        # wherever it is unpickled, the router's process included, which never loads torch

        torch.set_num_threads(torch.get_num_threads())  # OpenMP's count is per thread (see above)
        worker = self.worker
        while not self._stop.is_set():
            try:
                item = self._calls.get_nowait() if worker.has_work else self._calls.get()
            except queue.Empty:
                item = None
            if item is _WAKE:
                continue
            if item is not None:
                fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:
                        fut.set_exception(exc)
                continue
            self.num_steps += 1
            self._on_step(worker.step())
