"""`Cluster`: start (or join) Ray, place each pool's replicas with a placement group, start
the worker actors and the router actor, and wait until the router's health service says
SERVING; `stop` drains the router, closes the workers, removes the placement groups and,
for a cluster it started, shuts Ray down (its gcs/raylet/worker processes go with it).

A local cluster stays on loopback: Ray on 127.0.0.1 and every worker's KV endpoint and the
router on 127.0.0.1. Joining an existing cluster (`address`), workers bind their node's IP.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field

from cluster.config import ClusterConfig, PoolConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    pool: str
    role: str
    actor: object


@dataclass
class Cluster:
    config: ClusterConfig
    address: str | None = None          # a Ray address to join; None starts a local one
    workers: list[WorkerRecord] = field(default_factory=list)
    router_address: str = ""
    metrics_url: str = ""               # the router's Prometheus endpoint; "" when router.metrics_port is None
    http_url: str = ""                  # the router's OpenAI-compatible API (routes under /v1); "" when off
    _router: object = None
    _pgs: list = field(default_factory=list)
    _started_ray: bool = False
    # every worker's KV transfer service wants this credential (kv_transfer.config.TransferConfig.secret):
    # made here, per cluster, and handed to the workers through Ray, never written anywhere
    _kv_secret: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    def start(self, timeout_s: float = 300.0) -> str:
        if self.address is None:
            # Read when ray is first imported: binds a one-node cluster to loopback (never for
            # a real multi-node cluster).
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from cluster.actors import RouterActor
        from engine.core import resolve_model

        cfg = self.config
        resolve_model(cfg.model)  # a built-in model is written here once, before any actor reads it
        if self.address is None:
            need_cpus = sum(p.resources.num_cpus * (p.replicas + p.spare_replicas) for p in cfg.pools) + cfg.router.num_cpus
            custom: dict[str, float] = {}
            for p in cfg.pools:
                for k, v in p.resources.custom.items():
                    custom[k] = custom.get(k, 0.0) + v * (p.replicas + p.spare_replicas)
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=int(need_cpus + 0.999),
                     resources=custom or None, log_to_driver=False,
                     runtime_env={"env_vars": {"UCX_NET_DEVICES": "lo", "OMP_NUM_THREADS": "1"}})
            self._started_ray = True
        else:
            # Joining a cluster: no UCX_NET_DEVICES=lo here (workers pick their node's interface,
            # cluster.actors), but UCX settings given to the driver (UCX_TLS=tcp, ...) reach the workers.
            env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
            env.setdefault("OMP_NUM_THREADS", "1")
            ray.init(address=self.address, log_to_driver=False, runtime_env={"env_vars": env})
        local = self.address is None
        deadline = time.monotonic() + timeout_s
        try:
            for pool in cfg.pools:
                bundle = pool.resources.bundle() or {"CPU": 0.001}
                n = pool.replicas + pool.spare_replicas  # hot spares: workers pool-<replicas>, ... (cluster.actors)
                pg = placement_group([dict(bundle) for _ in range(n)], strategy=pool.placement_strategy,
                                     name=f"pdcluster-{pool.name}")
                self._pgs.append(pg)
                ray.get(pg.ready(), timeout=max(deadline - time.monotonic(), 1))
                for i in range(n):
                    self.workers.append(self._start_worker(pool, i, pg, local, PlacementGroupSchedulingStrategy))
            ray.get([w.actor.ready.remote() for w in self.workers], timeout=max(deadline - time.monotonic(), 1))
            prefills = [(w.worker_id, w.pool, w.actor) for w in self.workers if w.role == "prefill"]
            decodes = [(w.worker_id, w.pool, w.role, w.actor) for w in self.workers if w.role != "prefill"]
            self._router = ray.remote(RouterActor).options(num_cpus=cfg.router.num_cpus, name="pdcluster-router",
                                                           max_concurrency=10000).remote(cfg, prefills, decodes)
            self.router_address = ray.get(self._router.start.remote(), timeout=max(deadline - time.monotonic(), 1))
            # asked of the router actor, not over its port: that may want TLS and a key
            while not ray.get(self._router.serving.remote(), timeout=max(deadline - time.monotonic(), 1)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the router at {self.router_address} did not report SERVING within "
                                       f"{timeout_s:.0f}s")
                time.sleep(0.1)
            self.metrics_url = ray.get(self._router.metrics_url.remote(), timeout=10)
            self.http_url = ray.get(self._router.http_url.remote(), timeout=10)
        except BaseException:
            self.stop()
            raise
        return self.router_address

    def _start_worker(self, pool: PoolConfig, index: int, pg, local: bool, strategy_cls) -> WorkerRecord:
        import ray

        from cluster.actors import WorkerSpec
        from engine.async_worker import AsyncWorker

        shape = pool.resources
        extra = {k: v for k, v in shape.bundle().items() if k not in ("CPU", "GPU")}
        opts = dict(num_cpus=shape.num_cpus, num_gpus=shape.num_gpus, resources=extra or None,
                    scheduling_strategy=strategy_cls(placement_group=pg, placement_group_bundle_index=index),
                    max_concurrency=10000, name=f"pdcluster-{pool.name}-{index}", max_restarts=pool.max_restarts)
        wid = f"{pool.name}-{index}"
        t = self.config.transport
        spec = WorkerSpec(pool.role, self.config.model, pool.engine, t.kind, t.deadline_s, local, t.begin_timeout_s,
                          self._kv_secret)
        actor = ray.remote(AsyncWorker).options(**opts).remote(spec, wid, True)  # exit on a dead loop: Ray restarts
        return WorkerRecord(wid, pool.name, pool.role, actor)

    def stop(self, grace_s: float = 5.0) -> None:
        """Drain and stop; safe to call twice and after a failed start."""
        import ray

        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        if self._router is not None:
            try:
                ray.get(self._router.stop.remote(grace_s), timeout=grace_s + 10)
            except Exception as exc:
                log.warning("router stop: %s", exc)
            ray.kill(self._router)
            self._router = None
        closes = []
        for w in self.workers:
            try:
                closes.append(w.actor.close.remote())
            except Exception:
                pass
        try:
            ray.get(closes, timeout=20)
        except Exception as exc:
            log.warning("worker close: %s", exc)
        for w in self.workers:
            ray.kill(w.actor)
        self.workers.clear()
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self._pgs.clear()
        ray.shutdown()
