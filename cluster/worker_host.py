"""What a worker actor runs. A worker actor is `engine.async_worker.AsyncWorker` itself
(`ray.remote(AsyncWorker)`, cluster.runtime makes it), given a `WorkerSpec` that builds its
worker inside the actor's process; the worker it builds is wrapped in a `HostedWorker`: the
cluster's load report, the tensor-parallel group's watch, and the role switch of a move
(`pdcluster scale --move`, cluster.scaler).

Nothing here imports Ray, torch or a worker at module level.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

from cluster.node import bind_host, node_address, normal_priority, ucx_net_devices
from engine.load import WorkerLoad


@dataclass(slots=True)
class ClusterWorkerLoad(WorkerLoad):
    """A worker's load report as its actor sends it: the engine's WorkerLoad plus where its
    tensor-parallel ranks run and the torch threads of each (ClusterStatus shows them)."""

    tp_size: int = 1
    rank_pids: tuple = ()          # every rank's process, rank 0 (the worker's own) first
    rank_nodes: tuple = ()         # the node address of each rank
    num_threads: int = 0           # torch intra-op threads of each rank


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A worker to build in an actor's process: `spec()` returns it (the AsyncWorker's factory).

    The process runs at normal priority (nice 0) from here on and uses `threads` torch intra-op
    threads (its reserved whole CPUs). With `engine.tensor_parallel_size` N > 1 this actor is
    rank 0 of its group; ranks 1..N-1 are follower actors in the other bundles of its placement
    group (cluster.tp_group), each with `resources` and `threads` of its own."""

    role: str                 # "prefill", "decode" or "colocated"
    model: str
    engine: Any               # cluster.config.EngineSettings
    transport: str
    deadline_s: float
    local: bool = True        # bind loopback (a local cluster) or the node's address
    begin_timeout_s: float = 300.0
    kv_secret: str = field(default="", repr=False)  # the cluster's KV-plane credential (TransferConfig.secret)
    threads: int = 1          # torch intra-op threads of each rank
    resources: dict = field(default_factory=dict)  # each follower rank's actor resources (cluster.tp_group)
    name: str = "worker"

    @property
    def node(self) -> str:
        """The address of the node this runs on (asked in the actor's process)."""
        return node_address()

    def __call__(self):
        normal_priority()
        spec = self.switched() or self  # a worker moved to another pool comes back (a Ray restart) in that role
        return HostedWorker(spec._build(), spec)

    def _build(self, core=None):
        """The worker: a new engine, or with `core` an idle engine of another role (a role
        switch: PrefillWorker.over / DecodeWorker.over keep its weights and KV cache)."""
        from kv_transfer.config import TransferConfig

        cfg = TransferConfig(host=bind_host(self.local), deadline_s=self.deadline_s,
                             begin_timeout_s=self.begin_timeout_s, secret=self.kv_secret,
                             ucx_net_devices=ucx_net_devices(self.local))
        engine: dict = {}
        if core is None:
            import torch

            torch.set_num_threads(self.threads)  # the reserved whole CPUs (engine/loop.py applies it to its thread)
            engine = self.engine.engine_kwargs()
            if engine.get("tensor_parallel_size", 1) > 1:
                from cluster.tp_group import RayFollowers

                engine["tp_host"] = bind_host(self.local)
                engine["tp_launcher"] = RayFollowers.launcher(resources=self.resources, local=self.local,
                                                              num_threads=self.threads, name=self.name)
        limits = dict(max_num_batched_tokens=self.engine.max_num_batched_tokens, max_num_seqs=self.engine.max_num_seqs)
        if self.role == "prefill":
            from prefill_worker.worker import PrefillWorker

            if core is not None:
                return PrefillWorker.over(core, transport=self.transport, transfer_config=cfg, **limits)
            return PrefillWorker(self.model, transport=self.transport, transfer_config=cfg, **engine)
        from decode_worker.types import DecodeConfig, TransferFailurePolicy
        from decode_worker.worker import DecodeWorker

        colocated = self.role == "colocated"
        dcfg = DecodeConfig(local_prefill_threshold=0 if colocated else self.engine.local_prefill_threshold,
                            reserve_pages=self.engine.reserve_pages,
                            on_transfer_failure=TransferFailurePolicy(self.engine.on_transfer_failure))
        transport = None if colocated else self.transport
        if core is not None:
            return DecodeWorker.over(core, transport=transport, transfer_config=cfg, config=dcfg, **limits)
        return DecodeWorker(self.model, transport=transport, transfer_config=cfg, config=dcfg, **engine)

    # ---- a role switch outlives the process: Ray restarts the actor with its first spec --------
    def _role_key(self) -> bytes | None:
        """This actor's key in Ray's internal KV store, per cluster (the KV secret is per cluster);
        None outside a Ray actor."""
        import hashlib

        import ray

        name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
        if not name:
            return None
        return f"pdcluster/role/{hashlib.sha256(self.kv_secret.encode()).hexdigest()[:16]}/{name}".encode()

    def record_switch(self) -> None:
        """Remember this spec (its role and engine settings) for a restart of this actor."""
        import pickle

        from ray.experimental.internal_kv import _internal_kv_put

        key = self._role_key()
        if key is not None:
            _internal_kv_put(key, pickle.dumps((self.role, self.engine)), overwrite=True)

    def switched(self) -> WorkerSpec | None:
        """This spec with the role and engine settings of this actor's last role switch, or None."""
        import dataclasses
        import pickle

        from ray.experimental.internal_kv import _internal_kv_get

        key = self._role_key()
        got = _internal_kv_get(key) if key is not None else None
        if not got:
            return None
        role, engine = pickle.loads(got)
        return dataclasses.replace(self, role=role, engine=engine)


class HostedWorker:
    """A worker as its actor hosts it: every attribute is the worker's own, except that
    - its load report is a ClusterWorkerLoad (TP size, each rank's pid and node, threads), and
    - a tensor-parallel group that lost a rank ends the worker's process at once, from the
      step that found it (its outputs are dropped: its requests are the router's to move) or
      from a watcher thread that checks the followers every `WATCH_S` (a rank lost while the
      worker is idle); the remaining followers are killed first. Ray restarts the worker as a
      whole, new followers and all, as it restarts a killed worker process."""

    WATCH_S = 0.5
    # every role's calls (engine/async_worker.py checks a caller's method against these), and the
    # role switch; a call of another role than the worker's own now is refused (__getattr__)
    CALLS = ("submit", "admit", "cancel", "kv_events", "export_prefix", "abandon_fetch", "switch_role")
    ROLE_CALLS = ("submit", "admit")

    def __init__(self, worker: Any, spec: WorkerSpec) -> None:
        import threading

        import torch

        self._worker = worker
        self._spec = spec
        self._threads = torch.get_num_threads()
        self._node = node_address()
        self._lost: str | None = None
        self._followers = getattr(worker.core, "_tp_followers", None)
        self._stopped = threading.Event()
        if self._followers is not None:
            threading.Thread(target=self._watch, name=f"{spec.name}-tp-watch", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        if name in HostedWorker.ROLE_CALLS and name not in self._worker.CALLS:
            raise ValueError(f"this worker is a {self._spec.role} worker now: it takes {list(self._worker.CALLS)}, "
                             f"not {name!r}")
        return getattr(self._worker, name)

    def switch_role(self, role: str, engine) -> float:
        """Become a worker of `role` with the engine settings `engine` (a destination pool's)
        without a new process: the engine's weights, KV cache and cached prefixes stay, its
        connector and policies are the new role's (PrefillWorker.over / DecodeWorker.over). The
        worker must be idle (drained: RuntimeError otherwise; nothing changes). A later restart
        of this actor by Ray builds the new role. Returns the seconds the switch took. Runs on
        the engine thread (an AsyncWorker call)."""
        import dataclasses
        import time

        if role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role must be one of ['colocated', 'decode', 'prefill'], got {role!r}")
        if self._followers is not None:
            raise ValueError("a tensor-parallel worker cannot switch roles (its follower ranks' connectors are built "
                             "at start-up)")
        t0 = time.monotonic()
        spec = dataclasses.replace(self._spec, role=role, engine=engine)
        self._worker = spec._build(self._worker.core)
        self._spec = spec
        spec.record_switch()
        return time.monotonic() - t0

    def step(self):
        outputs = self._worker.step()
        if self._followers is not None:
            error = self._worker.core.tensor_parallel_error
            if error is not None:
                self._lost = error
                self._give_up()
        return outputs

    def load(self):
        from dataclasses import fields

        ld = self._worker.load()
        pids, nodes = [os.getpid()], [self._node]
        if self._followers is not None:
            with contextlib.suppress(Exception):  # a lost rank: its last known place, or none
                pids += self._followers.pids
                nodes += self._followers.nodes
        return ClusterWorkerLoad(**{f.name: getattr(ld, f.name) for f in fields(WorkerLoad)},
                                 tp_size=self._worker.core.tensor_parallel_size, rank_pids=tuple(pids),
                                 rank_nodes=tuple(nodes), num_threads=self._threads)

    def close(self) -> None:
        self._stopped.set()
        self._worker.close()

    def _give_up(self):
        """The group lost a rank: kill the remaining followers and end this process at once, as
        a killed worker process ends. The router then sees what any lost worker looks like (its
        streams migrate, the worker is "replacing" while Ray restarts it with a new group): an
        engine loop that died in a live process would read as a dead worker instead."""
        import logging
        import sys

        logging.getLogger(__name__).error("the worker's tensor-parallel group lost a rank: %s; the worker's process "
                                          "exits (Ray restarts it with a new group)", self._lost)
        with contextlib.suppress(Exception):
            self._followers.stop(0)
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(70)

    def _watch(self) -> None:
        from engine.parallel import TPGroupError

        while not self._stopped.wait(self.WATCH_S):
            try:
                self._followers.check()
            except TPGroupError as exc:
                if self._stopped.is_set():
                    return
                self._lost = self._lost or str(exc)
                self._give_up()
