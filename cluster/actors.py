"""The cluster's router actor and the router's reach into worker actors. `RouterActor` hosts
the gRPC server (and router 0 the SLA planner); it reaches each worker actor (cluster.worker_host)
through `RayActor`, the Ray form of router.handles.Remote.

Nothing here imports Ray, torch or a worker at module level: `cluster.runtime` makes the
actors, and the router's process loads this module without the engine.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from cluster.node import normal_priority
from engine.heap import freeze_startup_heap, gc_pauses


class RayActor:
    """router.handles.Remote over a Ray actor handle: a dead actor surfaces as an exception from
    the call or the stream, which the dispatcher treats as a lost worker."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.actor, method).remote(*args, **kwargs)

    async def stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        async for ref in getattr(self.actor, method).options(num_returns="streaming").remote(*args):
            yield await ref


def spare_ids(config) -> list[str]:
    """The worker ids that start as hot spares: in each pool, those past its `replicas`
    (cluster.runtime starts `replicas + spare_replicas` workers, named pool-0, pool-1, ...)."""
    return [f"{p.name}-{i}" for p in config.pools for i in range(p.replicas, p.replicas + p.spare_replicas)]


class RouterActor:
    """Hosts the gRPC server on the actor's event loop; workers are reached via Ray handles.

    Router `index` is `router-<index>` to the workers: its handles open channels named
    `router-<index>/<incarnation>-<worker>`, the incarnation new in each process. Ray restarts a
    lost router actor (its constructor runs again in a new process, with the same worker
    handles); `start()` then retires the predecessor's channels on every worker (its requests
    cancelled, their pages freed) before serving again on the ports it is given."""

    def __init__(self, config, prefills: list[tuple[str, str, object]], decodes: list[tuple[str, str, str, object]],
                 index: int = 0, max_replicas: int = 16, stores: list[tuple[str, object]] = ()) -> None:
        import uuid

        gc_pauses()  # time this process's garbage collections from the start
        # at nice 0 like the workers: at Ray's nice 15 a router on a node whose workers are busy
        # gets the CPU last, and every request's admission, placement and token waits for it
        normal_priority()
        self.config = config
        self.prefills, self.decodes = prefills, decodes
        self.stores = list(stores)  # [(store id, actor)]: the nodes' KV stores (cluster.store_host)
        self.index = index
        self.identity = f"router-{index}"
        self.incarnation = uuid.uuid4().hex[:8]
        self.server = None
        self.retired = 0  # requests of earlier incarnations this one cancelled on the workers
        self.autoscaler = None  # the SLA planner (cluster.autoscale), router 0's alone
        from router.service import PoolTargets

        # Scale's targets (router.service.PoolTargets): recorded here, reconciled by the driver
        from cluster.scaler import move_refusals

        self.pool_targets = PoolTargets({p.name: p.role for p in config.pools},
                                        {p.name: p.replicas for p in config.pools}, max_replicas,
                                        move_refusals(config))
        _attach_request_log(config.router.request_log, self.identity)

    def ports(self) -> tuple[int, int | None, int | None]:
        """(gRPC, HTTP, metrics) ports of this router from the config: port + index (0 stays 0:
        a free one), None for a door that is off."""
        r, i = self.config.router, self.index

        def of(port):
            return None if port is None else (port + i if port else 0)
        return of(r.port), of(r.http_port), of(r.metrics_port)

    async def start(self, ports: tuple[int, int | None, int | None] | None = None) -> str:
        """Serve; `ports` (gRPC, HTTP, metrics) replaces the configured ones (a router that came
        back takes the ports its first incarnation bound)."""
        from router.app import build_router
        from router.handles import WorkerHandle
        from router.http_server import HttpLimits
        from router.security import Access, Tls

        if self.server is not None:  # an earlier start() of this incarnation failed half-way
            await self.server.stop(0)
            self.server = None
        cfg, r = self.config, self.config.router
        port, http_port, metrics_port = ports or self.ports()
        self.retired = await self._retire_predecessors()
        prefix = f"{self.identity}/{self.incarnation}"
        prefills = [WorkerHandle(RayActor(a), wid, pool, "prefill", prefix) for wid, pool, a in self.prefills]
        decodes = [WorkerHandle(RayActor(a), wid, pool, role, prefix) for wid, pool, role, a in self.decodes]
        stores = [WorkerHandle(RayActor(a), sid, "kv-store", "store", prefix) for sid, a in self.stores]
        self.server = build_router(cfg.model, prefills, decodes, host=r.host, port=port, policy=r.policy,
                                   hash_page_size=cfg.hash_page_size, max_model_len=cfg.max_model_len,
                                   max_inflight=r.max_inflight, max_queue=r.max_queue,
                                   max_prefill_attempts=r.max_prefill_attempts, migration_limit=r.migration_limit,
                                   migration_wait_s=r.migration_wait_s, warm_up=True, http_port=http_port,
                                   access=Access(tuple(r.api_keys), r.open_health, r.open_metrics),
                                   tls=Tls(r.tls_cert, r.tls_key, r.tls_client_ca) if r.tls_cert else None,
                                   worker_timeout_s=r.worker_timeout_s, spares=spare_ids(cfg),
                                   fetch_min_pages=r.fetch_min_pages, stores=stores,
                                   http_limits=HttpLimits(r.http_max_body_bytes, r.http_header_timeout_s,
                                                          r.http_body_timeout_s, r.http_keep_alive_s,
                                                          r.http_max_connections))
        self.server.metrics_port = metrics_port
        self.server.service.pool_targets = self.pool_targets
        address = await self.server.start()
        if self.index == 0 and cfg.autoscale.mode != "off" and self.autoscaler is None:
            from cluster.autoscale import Autoscaler

            self.autoscaler = Autoscaler(cfg, self.server.service, self.pool_targets)
            self.autoscaler.start()
        freeze_startup_heap()
        return address

    async def _retire_predecessors(self, timeout_s: float = 10.0) -> int:
        """Ask every worker to cancel what earlier incarnations of this router had open there.
        A worker that does not answer in time (restarting itself) holds none of their requests."""
        import logging

        actors = [a for _, _, a in self.prefills] + [a for *_, a in self.decodes]

        async def one(actor):
            return await asyncio.wait_for(RayActor(actor).call("retire", self.identity, self.incarnation), timeout_s)

        done = await asyncio.gather(*(one(a) for a in actors), return_exceptions=True)
        cancelled = sum(n for n in done if isinstance(n, int))
        failed = [f"{type(e).__name__}: {e}" for e in done if isinstance(e, BaseException)]
        logging.getLogger(__name__).warning(
            "%s incarnation %s: %d request(s) of earlier incarnations cancelled on %d worker(s)%s", self.identity,
            self.incarnation, cancelled, len(actors) - len(failed),
            f"; not reached: {'; '.join(failed)}" if failed else "")
        return cancelled

    def serving(self) -> bool:
        """Whether the router's health says SERVING (asked here: no credentials needed)."""
        return self.server is not None and self.server.health_status == "SERVING"

    def info(self) -> dict:
        """What the cluster's supervisor watches: this process, its incarnation and whether it serves."""
        return {"pid": os.getpid(), "incarnation": self.incarnation, "started": self.server is not None,
                "serving": self.serving(), "address": self.server.address if self.server is not None else "",
                "retired": self.retired, "scale": dict(self.pool_targets.requests),
                "moves": list(self.pool_targets.moves),
                "autoscale_seq": self.autoscaler.seq if self.autoscaler is not None else 0}

    def autoscale_decisions(self, after: int = 0) -> list[tuple[int, str]]:
        """The SLA planner's latest decisions (seq, JSON line) numbered past `after`."""
        return self.autoscaler.since(after) if self.autoscaler is not None else []

    # ---- resizing pools: the driver's scaler (cluster.runtime) calls these ----------------------
    def set_workers(self, prefills: list, decodes: list) -> None:
        """The workers to serve, before start() (a restarted router gets the pools as they are
        now, not as its constructor's arguments had them)."""
        self.prefills, self.decodes = list(prefills), list(decodes)

    def scale_status(self, status: dict) -> None:
        """What the driver did about the targets (router.service.PoolTargets.status)."""
        self.pool_targets.status = status

    async def add_worker(self, wid: str, pool: str, role: str, actor, timeout_s: float = 120.0) -> float:
        """Warm a new worker up and place on it (router.dispatch.Dispatcher.add_worker); the
        seconds the warm-up took."""
        from router.handles import WorkerHandle

        if self.server is None:
            raise RuntimeError(f"{self.identity} is not serving")
        handle = WorkerHandle(RayActor(actor), wid, pool, role, f"{self.identity}/{self.incarnation}")
        took = await self.server.service.dispatcher.add_worker(handle, timeout_s)
        if role == "prefill":
            self.prefills.append((wid, pool, actor))
        else:
            self.decodes.append((wid, pool, role, actor))
        return took

    async def retire_worker(self, wid: str, grace_s: float) -> dict:
        """Drain a worker being removed (router.dispatch.Dispatcher.retire_worker)."""
        if self.server is None or wid not in self.server.service.dispatcher.views:
            return {"finished": 0, "moved": 0, "seconds": 0.0}
        return await self.server.service.dispatcher.retire_worker(wid, grace_s)

    async def remove_worker(self, wid: str) -> None:
        """Forget a drained (or never added) worker."""
        self.prefills = [p for p in self.prefills if p[0] != wid]
        self.decodes = [d for d in self.decodes if d[0] != wid]
        if self.server is not None:
            await self.server.service.dispatcher.remove_worker(wid)

    def http_url(self) -> str:
        """http://host:port of the OpenAI-compatible API (its routes under /v1), or "" when off."""
        return self.server.http_url if self.server is not None else ""

    def metrics_url(self) -> str:
        """http://host:port/metrics of the router, or "" when metrics are off."""
        return self.server.metrics_url if self.server is not None else ""

    def loaded_modules(self, prefixes: list[str]) -> list[str]:
        """Which modules starting with any of `prefixes` this process has imported (tests check
        that the router's process never loads torch or the model code)."""
        import sys

        return sorted(m for m in list(sys.modules) if any(m == p or m.startswith(p + ".") for p in prefixes))

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.stop()
            self.autoscaler = None
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None
        await asyncio.sleep(0)

    def pid(self) -> int:
        return os.getpid()


def _attach_request_log(where: str | None, router: str) -> None:
    """router.request_log: one JSON line per finished or failed request (logger
    `pdcluster.requests`, router.metrics.log_request) appended to a file, or to this process's
    standard error for "-", each line naming the router that served it."""
    if not where:
        return
    import json
    import logging
    import sys

    class RouterField(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            msg = record.getMessage()
            try:
                return json.dumps({"router": router, **json.loads(msg)}, separators=(",", ":"))
            except ValueError:
                return msg

    handler = logging.StreamHandler(sys.stderr) if where == "-" else logging.FileHandler(where, mode="a")
    handler.setFormatter(RouterField())
    logger = logging.getLogger("pdcluster.requests")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
