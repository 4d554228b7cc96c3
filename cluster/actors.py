"""The Ray actors: a prefill worker, a decode (or colocated) worker, and the router hosting
the gRPC server. Plain classes here; `cluster.runtime` turns them into actors with
`ray.remote(...).options(...)` so this module imports without starting Ray.

Each worker actor owns one worker behind its async front (the front's loop thread steps the
engine, the actor's event loop answers calls) and uses one intra-op thread.
"""
from __future__ import annotations

import asyncio
import os

from engine.heap import freeze_startup_heap, gc_pauses

BIG_THRESHOLD = 1 << 30  # a colocated worker prefills every prompt itself


def _setup_process() -> None:
    """One intra-op thread; time this process's garbage collections from the start."""
    import torch

    torch.set_num_threads(1)
    gc_pauses()


def _with_gc(load):
    """The worker's load view plus this process's garbage-collection pauses."""
    load.gc = gc_pauses().stats()
    return load


def _bind_host(local: bool) -> str:
    if local:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


class PrefillActor:
    def __init__(self, worker_id: str, pool: str, model: str, engine, transport: str, deadline_s: float,
                 local: bool = True, begin_timeout_s: float = 300.0) -> None:
        _setup_process()
        from cluster.worker_handles import LocalPrefillHandle
        from kv_transfer.config import TransferConfig
        from prefill_worker import AsyncPrefillWorker, PrefillWorker

        cfg = TransferConfig(host=_bind_host(local), deadline_s=deadline_s, begin_timeout_s=begin_timeout_s)
        worker = PrefillWorker(model, transport=transport, transfer_config=cfg, **engine.engine_kwargs())
        self.handle = LocalPrefillHandle(AsyncPrefillWorker(worker), worker_id, pool)

    async def ready(self) -> str:
        await self.handle.load()
        freeze_startup_heap()
        return self.handle.worker_id

    async def submit(self, task):
        return await self.handle.submit(task)

    async def cancel(self, request_id: str) -> bool:
        return await self.handle.cancel(request_id)

    async def load(self):
        return _with_gc(await self.handle.load())

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.handle.close()


class DecodeActor:
    def __init__(self, worker_id: str, pool: str, role: str, model: str, engine, transport: str, deadline_s: float,
                 local: bool = True, begin_timeout_s: float = 300.0) -> None:
        _setup_process()
        from cluster.worker_handles import LocalDecodeHandle
        from decode_worker import AsyncDecodeWorker, DecodeConfig, DecodeWorker, TransferFailurePolicy
        from kv_transfer.config import TransferConfig

        threshold = BIG_THRESHOLD if role == "colocated" else engine.local_prefill_threshold
        dcfg = DecodeConfig(local_prefill_threshold=threshold, reserve_pages=engine.reserve_pages,
                            on_transfer_failure=TransferFailurePolicy(engine.on_transfer_failure))
        cfg = TransferConfig(host=_bind_host(local), deadline_s=deadline_s, begin_timeout_s=begin_timeout_s)
        worker = DecodeWorker(model, transport=transport, transfer_config=cfg, config=dcfg, **engine.engine_kwargs())
        self.handle = LocalDecodeHandle(AsyncDecodeWorker(worker), worker_id, pool, role)
        self._channels: dict[str, asyncio.Queue] = {}
        self._pumps: set[asyncio.Task] = set()

    async def ready(self) -> str:
        await self.handle.load()
        freeze_startup_heap()
        return self.handle.worker_id

    async def admit(self, request_id, prompt_token_ids, params, channel: str):
        """Admit a request; its outputs go out on `channel`'s `outputs` stream (the router's)."""
        adm = await self.handle.admit(request_id, prompt_token_ids, params)
        q = self._channels.setdefault(channel, asyncio.Queue())
        task = asyncio.get_running_loop().create_task(self._pump(request_id, q))
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)
        return adm

    async def _pump(self, request_id: str, q: asyncio.Queue) -> None:
        async for out in self.handle.stream(request_id):
            q.put_nowait(out)

    async def outputs(self, channel: str):
        """One Ray stream per router: every output of the requests admitted on `channel`, in
        lists of whatever is ready (a step's worth for all of them). One Ray item per step
        instead of one per stream and step: the per-item cost (serialization, an object-store
        round, the caller's wake-up) was most of the serving path's cost per stream."""
        q = self._channels.setdefault(channel, asyncio.Queue())
        while True:
            batch = [await q.get()]
            while not q.empty():
                batch.append(q.get_nowait())
            yield batch

    async def wait_admitted(self, request_id):
        return await self.handle.wait_admitted(request_id)

    async def cancel(self, request_id: str) -> bool:
        return await self.handle.cancel(request_id)

    async def load(self):
        return _with_gc(await self.handle.load())

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.handle.close()


class RouterActor:
    """Hosts the gRPC server on the actor's event loop; workers are reached via Ray handles."""

    def __init__(self, config, prefills: list[tuple[str, str, object]], decodes: list[tuple[str, str, str, object]]) -> None:
        _setup_process()
        self.config = config
        self.prefills, self.decodes = prefills, decodes
        self.server = None

    async def start(self) -> str:
        from cluster.ray_handles import RayDecodeHandle, RayPrefillHandle
        from router.app import build_router

        cfg, r = self.config, self.config.router
        prefills = [RayPrefillHandle(a, wid, pool) for wid, pool, a in self.prefills]
        decodes = [RayDecodeHandle(a, wid, pool, role) for wid, pool, role, a in self.decodes]
        self.server = build_router(cfg.model, prefills, decodes, host=r.host, port=r.port, policy=r.policy,
                                   hash_page_size=cfg.hash_page_size, max_model_len=cfg.max_model_len,
                                   max_inflight=r.max_inflight, max_queue=r.max_queue,
                                   max_prefill_attempts=r.max_prefill_attempts, warm_up=True)
        self.server.metrics_port = r.metrics_port
        address = await self.server.start()
        freeze_startup_heap()
        return address

    def metrics_url(self) -> str:
        """http://host:port/metrics of the router, or "" when metrics are off."""
        return self.server.metrics_url if self.server is not None else ""

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None
        await asyncio.sleep(0)

    def pid(self) -> int:
        return os.getpid()
