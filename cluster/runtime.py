"""`Cluster`: start (or join) Ray, place each pool's replicas with a placement group, start
the worker actors and the router actors (`router.replicas`, each serving every worker), and
wait until each router's health service says SERVING; `stop` drains the routers, closes the
workers, removes the placement groups and, for a cluster it started, shuts Ray down (its
gcs/raylet/worker processes go with it).

A supervisor thread watches every router actor (`RouterActor.info`, twice a second). Ray
restarts a lost router's process (`router.max_restarts`); the supervisor sees the new process,
calls its `start()` with the ports its first incarnation bound, and says when it serves again.
A router that answers nothing for `router.worker_timeout_s` (a stopped or deadlocked process,
alive to Ray) is killed so that Ray restarts it. A router that cannot come back (its restarts
spent, or not serving within `router_return_timeout_s`) is recorded in `failure`, which
`pdcluster serve` exits on.

A worker of `engine.tensor_parallel_size` N > 1 gets a placement group of its own, one bundle
of the pool's resources per rank (strategy `resources.tp_placement`): its actor (rank 0) runs in
bundle 0 and starts its follower ranks in the others (cluster/tp_group.py).

A local cluster stays on loopback: Ray on 127.0.0.1 and every worker's KV endpoint and the
router on 127.0.0.1. Joining an existing cluster (`address`), workers bind their node's IP.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

from cluster.config import ClusterConfig, PoolConfig
from cluster.scaler import PoolScaling, WorkerRecord, _cause, _first_line

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RouterRecord:
    name: str                            # router-<index>; its Ray actor is pdcluster-<name>
    actor: object
    address: str = ""                    # host:port of its gRPC server
    http_url: str = ""
    metrics_url: str = ""
    pid: int = 0
    ports: tuple = (0, None, None)       # (gRPC, HTTP, metrics) it bound: a restarted router takes them again
    lost_at: float | None = None         # monotonic time of its last answer before a loss; None while serving
    last_answer: float = 0.0             # monotonic time of its last answer to the supervisor
    restarts: int = 0
    pushed: int = -1                     # the scale status (Cluster._status_seq) it was last told
    autoscale_seen: int = 0              # the last SLA planner decision of it logged here (cluster.autoscale)


@dataclass
class Cluster(PoolScaling):
    config: ClusterConfig
    address: str | None = None          # a Ray address to join; None starts a local one
    workers: list[WorkerRecord] = field(default_factory=list)
    router_address: str = ""            # router 0's (router_addresses: all of them)
    metrics_url: str = ""               # router 0's Prometheus endpoint; "" when router.metrics_port is None
    http_url: str = ""                  # router 0's OpenAI-compatible API (routes under /v1); "" when off
    routers: list[RouterRecord] = field(default_factory=list)
    stores: list = field(default_factory=list)  # [(store id, actor)]: one KV store per node (cluster.store_host)
    router_return_timeout_s: float = 60.0  # a lost router not serving again within this is a failure
    watch_interval_s: float = 0.5
    on_event: Callable[[str], None] | None = None  # told of a router's loss, return or failure (one line each)
    failure: str = ""                   # why a router cannot come back; "" while all can
    # resizing pools at run time (the Scale RPC; see _reconcile)
    max_replicas: int = 16              # the largest target a pool accepts
    scale_headroom: int = 1             # a local Ray gets resources for this many more workers per pool
    drain_grace_s: float = 30.0         # a scale-in's streams finish within this, then move elsewhere
    start_timeout_s: float = 300.0      # a scale-out's worker built and ready within this, else it failed
    targets: dict = field(default_factory=dict)       # pool -> target serving workers
    _target_stamp: dict = field(default_factory=dict)  # pool -> time.time() of the Scale call it came from
    _next_index: dict = field(default_factory=dict)    # pool -> the index of its next new worker
    _free_bundles: dict = field(default_factory=dict)  # pool -> [(pg, bundle)] left by scaled-in workers
    _start_failures: dict = field(default_factory=dict)
    _pool_error: dict = field(default_factory=dict)
    _retry_at: dict = field(default_factory=dict)      # pool -> monotonic time of its next start try
    _stopped: list = field(default_factory=list)       # the last workers scaled in (status: "stopped")
    _moves: list = field(default_factory=list)         # [(from pool, to pool)]: one entry per worker still to move
    _move_stamp: float = 0.0                           # time.time() of the last move request taken
    _status_seq: int = 0                               # bumped on every change the routers must be told
    _scaler: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _watcher: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
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
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        from cluster.actors import RouterActor
        from cluster.config import check_model_fit
        from cluster.ray_start import init_local
        from engine.core import resolve_model

        cfg = self.config
        resolve_model(cfg.model)  # a built-in model is written here once, before any actor reads it
        check_model_fit(cfg)  # a tensor_parallel_size that does not divide the heads: before anything starts
        if self.address is None:
            def ranks(p: PoolConfig) -> int:
                # room for scale_headroom more workers of each pool (a Scale beyond waits for resources)
                auto = cfg.autoscale.pools.get(p.name) if cfg.autoscale.mode == "on" else None
                more = max(self.scale_headroom, auto.max_replicas - p.replicas if auto else 0)
                return (p.replicas + p.spare_replicas + more) * p.engine.tensor_parallel_size
            need_cpus = (sum(p.resources.num_cpus * ranks(p) for p in cfg.pools)
                         + cfg.router.num_cpus * cfg.router.replicas)
            custom: dict[str, float] = {}
            for p in cfg.pools:
                for k, v in p.resources.custom.items():
                    custom[k] = custom.get(k, 0.0) + v * ranks(p)
            init_local(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=int(need_cpus + 0.999),
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
            from cluster.store_host import await_stores, launch_stores

            self.stores = launch_stores(cfg, local, self._kv_secret)  # built while the workers load their models
            for pool in cfg.pools:
                bundle = pool.resources.bundle() or {"CPU": 0.001}
                n = pool.replicas + pool.spare_replicas  # hot spares: workers pool-<replicas>, ... (cluster.actors)
                tp = pool.engine.tensor_parallel_size
                if tp == 1:  # one placement group for the pool, one bundle per worker
                    pg = placement_group([dict(bundle) for _ in range(n)], strategy=pool.placement_strategy,
                                         name=f"pdcluster-{pool.name}")
                    self._pgs.append(pg)
                    ray.get(pg.ready(), timeout=max(deadline - time.monotonic(), 1))
                    for i in range(n):
                        self.workers.append(self._start_worker(pool, i, pg, i, local,
                                                               PlacementGroupSchedulingStrategy))
                    self._pool_started(pool, n)
                    continue
                for i in range(n):  # a tensor-parallel worker: its own group, one bundle per rank, rank 0 in bundle 0
                    pg = placement_group([dict(bundle) for _ in range(tp)], strategy=pool.resources.tp_placement,
                                         name=f"pdcluster-{pool.name}-{i}")
                    self._pgs.append(pg)
                    ray.get(pg.ready(), timeout=max(deadline - time.monotonic(), 1))
                    self.workers.append(self._start_worker(pool, i, pg, 0, local, PlacementGroupSchedulingStrategy))
                    self.workers[-1].own_pg = True
                self._pool_started(pool, n)
            self._await_ready(deadline)
            await_stores(cfg, self.stores, max(deadline - time.monotonic(), 1))
            prefills = [(w.worker_id, w.pool, w.actor) for w in self.workers if w.role == "prefill"]
            decodes = [(w.worker_id, w.pool, w.role, w.actor) for w in self.workers if w.role != "prefill"]
            # the routers run on this node (where `pdcluster serve` runs: the head of a KubeRay
            # cluster), their restarts too: their addresses are this host's
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            for i in range(cfg.router.replicas):
                name = f"router-{i}"
                actor = ray.remote(RouterActor).options(num_cpus=cfg.router.num_cpus, name=f"pdcluster-{name}",
                                                        max_concurrency=10000, scheduling_strategy=here,
                                                        max_restarts=cfg.router.max_restarts).remote(
                    cfg, prefills, decodes, i, self.max_replicas, self.stores)
                self.routers.append(RouterRecord(name, actor))
            for r in self.routers:
                # one after another: each router's warm-up runs requests named after the worker pair
                # (router/dispatch.py), which two routers warming at once would both use
                r.address = ray.get(r.actor.start.remote(), timeout=max(deadline - time.monotonic(), 1))
            for r in self.routers:
                # asked of the router actor, not over its port: that may want TLS and a key
                while not ray.get(r.actor.serving.remote(), timeout=max(deadline - time.monotonic(), 1)):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the router at {r.address} did not report SERVING within "
                                           f"{timeout_s:.0f}s")
                    time.sleep(0.1)
                self._describe(r)
                r.last_answer = time.monotonic()
            first = self.routers[0]
            self.router_address, self.metrics_url, self.http_url = first.address, first.metrics_url, first.http_url
            self._watcher = threading.Thread(target=self._watch, name="pdcluster-router-watch", daemon=True)
            self._watcher.start()
            self._push_status()
            self._scaler = threading.Thread(target=self._scale_loop, name="pdcluster-scaler", daemon=True)
            self._scaler.start()
        except BaseException:
            self.stop()
            raise
        return self.router_address

    @property
    def _router(self):
        """Router 0's actor handle (what callers of the one-router cluster used)."""
        return self.routers[0].actor if self.routers else None

    @property
    def router_addresses(self) -> list[str]:
        """host:port of every router's gRPC server, router 0 first."""
        return [r.address for r in self.routers]

    def _describe(self, r: RouterRecord) -> None:
        """Fill in a serving router's addresses, process and the ports it bound."""
        import ray

        info, r.http_url, r.metrics_url = ray.get([r.actor.info.remote(), r.actor.http_url.remote(),
                                                   r.actor.metrics_url.remote()], timeout=30)
        r.pid, r.address = info["pid"], info["address"]

        def port(url: str):
            return urlparse(url).port if url else None
        r.ports = (int(r.address.rsplit(":", 1)[1]), port(r.http_url), port(r.metrics_url))

    # ---- the router supervisor ----------------------------------------------------------------
    def _say(self, line: str, level: int = logging.WARNING) -> None:
        log.log(level, "%s", line)
        if self.on_event is not None:
            self.on_event(line)

    def _watch(self) -> None:
        while not self._stopping.wait(self.watch_interval_s):
            for r in self.routers:
                if self._stopping.is_set() or self.failure:
                    return
                try:
                    self._check(r)
                except Exception as exc:  # the supervisor never dies of one odd answer
                    log.warning("router supervisor: %s: %s: %s", r.name, type(exc).__name__, exc)

    def _check(self, r: RouterRecord) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        spent = r.restarts >= self.config.router.max_restarts
        try:
            asked = time.monotonic()
            info = ray.get(r.actor.info.remote(), timeout=2)
        except RayActorError as exc:  # its process is gone: Ray restarts it, unless its restarts are spent
            if spent:
                self._fail(r, f"its process is gone and Ray will not restart it (router.max_restarts "
                              f"{self.config.router.max_restarts} spent): {_first_line(exc)}")
                return
            self._lost(r, f"its process is gone ({type(exc).__name__})")
            self._overdue(r)
            return
        except GetTimeoutError:  # restarting, too busy to answer now, or hung
            silent = time.monotonic() - r.last_answer
            if r.lost_at is None and r.last_answer and silent > self.config.router.worker_timeout_s:
                # alive to Ray but answering nothing (stopped, deadlocked): kill it so that Ray restarts it
                if spent:
                    self._fail(r, f"it answered nothing for {silent:.1f} s and Ray will not restart it "
                                  f"(router.max_restarts {self.config.router.max_restarts} spent)")
                    return
                self._lost(r, f"it answered nothing for {silent:.1f} s (router.worker_timeout_s="
                              f"{self.config.router.worker_timeout_s:g}): killed so that Ray restarts it")
                ray.kill(r.actor, no_restart=False)
            self._overdue(r)
            return
        if info["pid"] != r.pid:
            self._lost(r, "its process is gone")
        self._adopt(info.get("scale") or {}, info.get("moves") or ())
        self._autoscale_lines(r, info.get("autoscale_seq", 0))
        if r.lost_at is None:
            r.last_answer = asked
            return
        if not info["started"]:
            try:
                # the pools as they are now (scaled since the router's constructor was given them)
                ray.get(r.actor.set_workers.remote(*self._worker_lists()), timeout=10)
                ray.get(r.actor.start.remote(r.ports), timeout=max(self.router_return_timeout_s, 1))
            except Exception as exc:
                log.warning("%s: start after its loss failed: %s: %s", r.name, type(exc).__name__, _first_line(exc))
                self._overdue(r)
                return
        if ray.get(r.actor.serving.remote(), timeout=10):
            took = time.monotonic() - r.lost_at
            self._describe(r)
            r.lost_at = None
            r.restarts += 1
            retired = ray.get(r.actor.info.remote(), timeout=10)["retired"]
            r.pushed = -1  # a new process: tell it the pools' status again
            self._say(f"{r.name} back: serving on {r.address} again (pid {r.pid}), {took:.1f} s after the last "
                      f"answer of its lost process; {retired} request(s) of its predecessor cancelled on the workers")
        else:
            self._overdue(r)

    def _autoscale_lines(self, r: RouterRecord, seq: int) -> None:
        """Log the SLA planner's new decisions (one JSON line each; cluster.autoscale)."""
        import ray

        if seq < r.autoscale_seen:  # a new process: its count starts again
            r.autoscale_seen = 0
        if seq == r.autoscale_seen:
            return
        try:
            lines = ray.get(r.actor.autoscale_decisions.remote(r.autoscale_seen), timeout=5)
        except Exception as exc:  # next time
            log.warning("%s: autoscale decisions: %s", r.name, _first_line(exc))
            return
        for n, line in lines:
            self._say(f"autoscale: {line}", logging.INFO)
            r.autoscale_seen = n

    def _lost(self, r: RouterRecord, why: str) -> None:
        if r.lost_at is None:
            r.lost_at = r.last_answer or time.monotonic()
            self._say(f"{r.name} lost (pid {r.pid}): {why}; waiting for Ray to restart it")

    def _overdue(self, r: RouterRecord) -> None:
        if r.lost_at is not None and time.monotonic() - r.lost_at > self.router_return_timeout_s:
            self._fail(r, f"not serving again within {self.router_return_timeout_s:.0f} s of its loss")

    def _fail(self, r: RouterRecord, why: str) -> None:
        self.failure = f"{r.name} (last on {r.address}) cannot come back: {why}"
        self._say(self.failure, logging.ERROR)

    def _await_ready(self, deadline: float) -> None:
        """Every worker built and its engine thread running; a worker that could not start (an
        engine setting its model or hardware refuses) raises, naming the worker and the reason."""
        import ray

        refs = [w.actor.ready.remote() for w in self.workers]
        try:
            ray.get(refs, timeout=max(deadline - time.monotonic(), 1))
        except ray.exceptions.GetTimeoutError:
            raise
        except Exception:
            for w, ref in zip(self.workers, refs):
                try:
                    ray.get(ref, timeout=max(deadline - time.monotonic(), 1))
                except Exception as exc:
                    raise RuntimeError(f"worker {w.worker_id} (pool {w.pool}, role {w.role}) could not start: "
                                       f"{_cause(exc)}") from exc
            raise

    def _start_worker(self, pool: PoolConfig, index: int, pg, bundle: int, local: bool,
                      strategy_cls) -> WorkerRecord:
        import ray

        from cluster.worker_host import WorkerSpec
        from engine.async_worker import AsyncWorker

        shape = pool.resources
        extra = {k: v for k, v in shape.bundle().items() if k not in ("CPU", "GPU")}
        opts = dict(num_cpus=shape.num_cpus, num_gpus=shape.num_gpus, resources=extra or None,
                    scheduling_strategy=strategy_cls(placement_group=pg, placement_group_bundle_index=bundle),
                    max_concurrency=10000, name=f"pdcluster-{pool.name}-{index}", max_restarts=pool.max_restarts)
        wid = f"{pool.name}-{index}"
        t = self.config.transport
        spec = WorkerSpec(pool.role, self.config.model, pool.engine, t.kind, t.deadline_s, local, t.begin_timeout_s,
                          self._kv_secret, threads=shape.threads, resources=shape.follower_options(), name=wid)
        actor = ray.remote(AsyncWorker).options(**opts).remote(spec, wid, True)  # exit on a dead loop: Ray restarts
        return WorkerRecord(wid, pool.name, pool.role, actor)

    def stop(self, grace_s: float = 5.0) -> None:
        """Drain and stop; safe to call twice and after a failed start."""
        import ray

        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        self._stopping.set()
        for t in (self._watcher, self._scaler):
            if t is not None and t is not threading.current_thread():
                t.join(timeout=60)
        self._watcher = self._scaler = None
        stops = [r.actor.stop.remote(grace_s) for r in self.routers]
        for r, ref in zip(self.routers, stops):
            try:
                ray.get(ref, timeout=grace_s + 10)
            except Exception as exc:
                log.warning("%s stop: %s", r.name, _first_line(exc))
        for r in self.routers:
            ray.kill(r.actor, no_restart=True)
        self.routers.clear()
        closes = []
        for w in self.workers:
            if w.actor is None:  # a scale-out's worker not built yet
                continue
            try:
                closes.append(w.actor.close.remote())
            except Exception:
                pass
        try:
            ray.get(closes, timeout=20)
        except Exception as exc:
            log.warning("worker close: %s", exc)
        for _, store in self.stores:
            try:
                ray.get(store.close.remote(), timeout=10)
            except Exception as exc:
                log.warning("KV store close: %s", _first_line(exc))
            ray.kill(store)
        self.stores = []
        for w in self.workers:
            if w.actor is not None:
                ray.kill(w.actor)
            if w.own_pg and w.pg is not None and w.pg not in self._pgs:
                self._pgs.append(w.pg)
        self.workers.clear()
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self._pgs.clear()
        ray.shutdown()
