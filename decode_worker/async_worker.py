"""`AsyncDecodeWorker`: the asyncio front of a DecodeWorker.

A background loop thread owns the worker (engine objects are single-threaded): it runs the
calls coroutines hand it, steps the worker while it has work, and delivers each request's
outputs to that request's asyncio queue on the caller's event loop. Coroutines never touch
the worker directly, so the event loop is never blocked by a model step.

    front = AsyncDecodeWorker(DecodeWorker(model, transport="nixl"))
    adm = await front.admit(rid, prompt_ids, params)       # maybe QUEUED_FOR_PAGES
    adm = await front.wait_admitted(rid)                   # descriptor ready (or LOCAL_PREFILL)
    async for out in front.stream(rid): ...                # DecodeOutput until finished
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from decode_worker.types import Admission, DecodeLoad, DecodeOutput
from decode_worker.worker import DecodeStage, DecodeWorker
from engine.loop_thread import EngineLoopThread
from engine.sampling_params import SamplingParams


class AsyncDecodeWorker(EngineLoopThread):
    def __init__(self, worker: DecodeWorker, idle_s: float = 0.002) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._admitted: dict[str, asyncio.Future] = {}
        self._lock = threading.Lock()
        super().__init__(worker, "decode-worker-loop", idle_s)

    # ---- coroutines -----------------------------------------------------------------------
    async def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Admission:
        loop = asyncio.get_running_loop()
        with self._lock:
            self._streams[request_id] = (loop, asyncio.Queue())
            self._admitted[request_id] = loop.create_future()
        try:
            adm = await self._run(lambda: self.worker.admit(request_id, prompt_token_ids, params))
        except Exception:
            with self._lock:
                self._streams.pop(request_id, None)
                self._admitted.pop(request_id, None)
            raise
        if adm.stage != DecodeStage.QUEUED_FOR_PAGES:
            self._resolve(request_id, adm)
        return adm

    async def wait_admitted(self, request_id: str) -> Admission:
        """The admission with pages (and descriptor), once a queued request gets them."""
        return await self._admitted[request_id]

    async def stream(self, request_id: str) -> AsyncIterator[DecodeOutput]:
        _, q = self._streams[request_id]
        try:
            while True:
                out = await q.get()
                yield out
                if out.finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                self._admitted.pop(request_id, None)

    async def cancel(self, request_id: str) -> bool:
        return await self._run(lambda: self.worker.cancel(request_id))

    async def load(self) -> DecodeLoad:
        return await self._run(self.worker.load)

    # ---- the loop thread ------------------------------------------------------------------
    def _resolve(self, request_id: str, adm: Admission) -> None:
        with self._lock:
            fut = self._admitted.get(request_id)
            entry = self._streams.get(request_id)
        if fut is not None and entry is not None:
            entry[0].call_soon_threadsafe(lambda: fut.done() or fut.set_result(adm))

    def _on_step(self, result) -> None:
        for adm in result.admissions:
            self._resolve(adm.request_id, adm)
        # One wake-up of each caller loop per step, not one per output: every
        # call_soon_threadsafe writes to the loop's self-pipe.
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in result.outputs:
                entry = self._streams.get(out.request_id)
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)
