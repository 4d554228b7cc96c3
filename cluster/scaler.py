"""Resizing pools at run time: the driver's scaler (`PoolScaling`, part of cluster.runtime's
`Cluster`). The routers record what the Scale RPC asks (router.service.PoolTargets: each pool's
target of serving workers, and moves of workers between pools); a thread here reads them from
every router, and makes one change at a time until each pool has its target:

- scale-out: a worker started in the pool's placement (a bundle a scaled-in worker left, or a
  new group), built, warmed up by every router (one request through each of its pairs), then
  placed on; a worker that fails to start is reported and the pool's next try backs off;
- scale-in: the least loaded worker drained (out of placement, its streams finish, or move with
  identical tokens after `drain_grace_s`, its pages come back), then stopped;
- move (`scale --move N --from A --to B`): the least loaded worker of A drained as for a
  scale-in, its role switched inside its running process (cluster.worker_host.HostedWorker.switch_role:
  the weights, the KV cache and its cached prefixes stay; the connector and policies are B's),
  then warmed up and placed on as B's newest worker. Only pools whose workers are built alike
  can trade them (`move_refusal`).

What it did goes back to the routers (`scale_status`), which ClusterStatus shows: each pool's
target and serving workers, and every worker not simply serving (starting, warming, draining,
switching, failed, stopped).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from cluster.config import ClusterConfig, PoolConfig

log = logging.getLogger("cluster.runtime")

# the engine settings a worker's engine is built with: pools that trade workers must agree on them
ENGINE_SHAPE = ("tensor_parallel_size", "page_size", "num_pages", "max_model_len", "dtype", "attention_backend")


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    pool: str
    role: str
    actor: object
    state: str = "serving"     # starting, warming, serving, draining, switching (a move), failed, stopped
    spare: bool = False        # a hot spare (started past the pool's replicas): never scaled in
    pg: object = None          # its placement group and bundle
    bundle: int = 0
    own_pg: bool = False       # the group is this worker's alone (added by a scale-out, or a TP group)
    error: str = ""
    moving_to: str = ""        # the pool a move takes it to, while it drains, switches and warms up


def move_refusal(config: ClusterConfig | list[PoolConfig], frm: str, to: str) -> str | None:
    """Why workers of pool `frm` cannot move to pool `to`, or None. A moved worker keeps its
    process, its engine and its placement, so the two pools must build engines alike (the
    ENGINE_SHAPE settings) on the same resources; a tensor-parallel worker's follower ranks
    built their connectors at start-up and cannot switch. The step's limits and the decode
    policies are the destination's."""
    pools = {p.name: p for p in getattr(config, "pools", config)}
    a, b = pools.get(frm), pools.get(to)
    if a is None or b is None or frm == to:
        return f"both must be distinct pools of {sorted(pools)}"
    if a.engine.tensor_parallel_size > 1 or b.engine.tensor_parallel_size > 1:
        return "tensor-parallel workers cannot switch roles (their follower ranks' connectors are built at start-up)"
    differ = [f"engine.{k} {getattr(a.engine, k)!r} vs {getattr(b.engine, k)!r}" for k in ENGINE_SHAPE
              if getattr(a.engine, k) != getattr(b.engine, k)]
    if a.resources != b.resources:
        differ.append("resources differ (a moved worker keeps its placement)")
    return "; ".join(differ) if differ else None


def move_refusals(config: ClusterConfig | list[PoolConfig]) -> dict[tuple[str, str], str]:
    """(from, to) -> why not, for every pair of the config's pools (or of `config`, a list of
    pools) that cannot trade workers."""
    names = [p.name for p in getattr(config, "pools", config)]
    out = {}
    for frm in names:
        for to in names:
            if frm != to and (why := move_refusal(config, frm, to)) is not None:
                out[(frm, to)] = why
    return out


class PoolScaling:
    """The scaler's half of `Cluster` (cluster.runtime): its state is Cluster's fields
    (targets, _moves, _free_bundles, ...); `_scale_loop` runs in a thread of the driver."""

    def _pool_started(self, pool: PoolConfig, n: int) -> None:
        """The pool's first workers are up: the non-spare ones serve, the rest are hot spares."""
        for w in self.workers[-n:]:
            w.spare = int(w.worker_id.rsplit("-", 1)[1]) >= pool.replicas
        self.targets[pool.name] = pool.replicas
        self._next_index[pool.name] = n

    def scale(self, pool: str, replicas: int) -> None:
        """Set a pool's target in this process (what the Scale RPC does through a router)."""
        if pool not in self.targets or not 1 <= replicas <= self.max_replicas:
            raise ValueError(f"pool must be one of {sorted(self.targets)} and replicas in [1, {self.max_replicas}], "
                             f"got {pool!r}, {replicas}")
        self._adopt({pool: (time.time(), replicas)})

    def move(self, frm: str, to: str, n: int = 1) -> None:
        """Move `n` serving workers of pool `frm` to pool `to` (what `scale --move` does through a
        router); a refused move is reported in the pool's error (ClusterStatus) and the log."""
        why = move_refusal(self.config, frm, to)
        if why is not None:
            raise ValueError(f"workers cannot move from pool {frm!r} to {to!r}: {why}")
        self._adopt({}, [(time.time(), frm, to, n)])

    def _adopt(self, requests: dict, moves: list | tuple = ()) -> None:
        """What a router recorded: targets (pool -> (time of the Scale call, replicas)), the newest
        winning, and moves ((time of the call, from, to, workers)), each taken once, in order."""
        with self._lock:
            for pool, (stamp, replicas) in requests.items():
                if pool in self.targets and stamp > self._target_stamp.get(pool, 0.0):
                    self._target_stamp[pool] = stamp
                    if self.targets[pool] != replicas:
                        self._say(f"pool {pool}: target {self.targets[pool]} -> {replicas} replicas", logging.INFO)
                        self.targets[pool] = replicas
                        self._retry_at.pop(pool, None)
                    self._status_seq += 1
            for stamp, frm, to, n in sorted(tuple(m) for m in moves):
                if stamp <= self._move_stamp or frm not in self.targets or to not in self.targets:
                    continue
                self._move_stamp = stamp
                why = move_refusal(self.config, frm, to)
                n = min(n, self.targets[frm] - 1, self.max_replicas - self.targets[to])
                if why is not None or n < 1:
                    self._pool_error[frm] = (f"move to {to} refused: {why or 'no worker can move now (one stays)'}")
                    self._say(f"pool {frm}: {self._pool_error[frm]}")
                    continue
                self._say(f"pool {frm}: moving {n} worker(s) to pool {to} (targets {frm} {self.targets[frm]} -> "
                          f"{self.targets[frm] - n}, {to} {self.targets[to]} -> {self.targets[to] + n})", logging.INFO)
                self.targets[frm] -= n
                self.targets[to] += n
                for pool in (frm, to):
                    self._target_stamp[pool] = max(self._target_stamp.get(pool, 0.0), stamp)
                self._moves += [(frm, to)] * n
                self._status_seq += 1

    def _members(self, pool: str) -> list[WorkerRecord]:
        """The pool's workers that count toward its replicas: neither spares nor leaving; a
        worker being moved counts toward the pool it joins."""
        return [w for w in self.workers if not w.spare and (w.moving_to == pool or (
            w.pool == pool and not w.moving_to and w.state in ("starting", "warming", "serving")))]

    def _scale_loop(self) -> None:
        while not self._stopping.wait(self.watch_interval_s):
            try:
                self._reconcile()
                self._push_status()
            except Exception as exc:  # the scaler never dies of one odd answer
                log.warning("scaler: %s: %s", type(exc).__name__, _first_line(exc))

    def _reconcile(self) -> None:
        """One step toward every pool's target: move one worker (moves first: the targets they
        changed count the workers being moved), start one, or remove one."""
        if self._moves:
            frm, to = self._moves.pop(0)
            self._move(frm, to)
            return
        for pool in self.config.pools:
            if self._stopping.is_set() or self.failure:
                return
            have, want = len(self._members(pool.name)), self.targets.get(pool.name, pool.replicas)
            if have < want and time.monotonic() >= self._retry_at.get(pool.name, 0.0):
                self._scale_out(pool)
            elif have > want:
                self._scale_in(pool)

    def _worker_lists(self) -> tuple[list, list]:
        """(prefills, decodes) as RouterActor takes them: the workers every router has."""
        live = [w for w in self.workers if w.state in ("serving", "draining") or (w.spare and w.state == "serving")]
        return ([(w.worker_id, w.pool, w.actor) for w in live if w.role == "prefill"],
                [(w.worker_id, w.pool, w.role, w.actor) for w in live if w.role != "prefill"])

    def _scale_out(self, pool: PoolConfig) -> None:
        """Start one worker of `pool` (its placement as at start-up), wait until it is built, then
        have every router warm it up and place on it. A failure is reported (status, log) and the
        pool's next try waits (1, 2, 4, ... 60 s)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        index = self._next_index[pool.name]
        self._next_index[pool.name] = index + 1
        tp = pool.engine.tensor_parallel_size
        free = self._free_bundles.get(pool.name, [])
        t0 = time.monotonic()
        pg, own, started = None, False, 0.0
        record = WorkerRecord(f"{pool.name}-{index}", pool.name, pool.role, None, state="starting")
        with self._lock:
            self.workers.append(record)
            self._status_seq += 1
        self._push_status()
        try:
            if tp == 1 and free:  # a bundle a scaled-in worker left in the pool's group
                pg, bundle = free.pop()
                own = False
            else:
                bundles = [dict(pool.resources.bundle() or {"CPU": 0.001}) for _ in range(tp)]
                pg = placement_group(bundles, strategy=pool.resources.tp_placement if tp > 1
                                     else pool.placement_strategy, name=f"pdcluster-{pool.name}-{index}")
                bundle, own = 0, True
            record.pg, record.bundle, record.own_pg = pg, bundle, own
            self._await_placement(pool.name, pg)
            built = self._start_worker(pool, index, pg, bundle, self.address is None, PlacementGroupSchedulingStrategy)
            record.actor = built.actor
            ray.get(record.actor.ready.remote(), timeout=max(self.start_timeout_s - (time.monotonic() - t0), 1))
            started = time.monotonic() - t0
            record.state = "warming"
            self._status_seq += 1
            self._push_status()
            warm = 0.0
            for r in self.routers:  # one after another, as at start-up (warm-up request ids per pair)
                warm = max(warm, ray.get(r.actor.add_worker.remote(record.worker_id, pool.name, pool.role,
                                                                   record.actor), timeout=180))
        except Exception as exc:
            if isinstance(exc, _NotWanted):  # the target came down while its placement waited: no failure
                why = str(exc)
                self._say(f"pool {pool.name}: scale-out of {record.worker_id} given up: {why}", logging.INFO)
            else:
                fails = self._start_failures.get(pool.name, 0) + 1
                self._start_failures[pool.name] = fails
                wait = min(2.0 ** (fails - 1), 60.0)
                self._retry_at[pool.name] = time.monotonic() + wait
                why = f"{type(exc).__name__}: {_cause(exc)}"
                self._pool_error[pool.name] = (f"worker {record.worker_id} failed to start ({why}); next try in "
                                               f"{wait:g} s")
                self._say(f"pool {pool.name}: scale-out: {self._pool_error[pool.name]}")
            for r in self.routers:
                try:
                    ray.get(r.actor.remove_worker.remote(record.worker_id), timeout=10)
                except Exception:
                    pass
            if record.actor is not None:
                try:
                    ray.kill(record.actor)
                except Exception:
                    pass
            if own and pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception:
                    pass
            elif record.pg is not None:
                free.append((record.pg, record.bundle))
                self._free_bundles[pool.name] = free
            record.state, record.error = ("stopped" if isinstance(exc, _NotWanted) else "failed"), why[:300]
            with self._lock:
                self.workers.remove(record)
                self._stopped = (self._stopped + [record])[-8:]
                self._status_seq += 1
            return
        record.state = "serving"
        self._start_failures[pool.name] = 0
        self._pool_error[pool.name] = ""
        self._status_seq += 1
        self._say(f"pool {pool.name}: worker {record.worker_id} serving, {time.monotonic() - t0:.1f} s after the "
                  f"scale-out began (built and ready in {started:.1f} s, warm-up {warm:.2f} s)", logging.INFO)

    def _await_placement(self, pool: str, pg) -> None:
        """Wait for a new worker's placement group (resources a joined cluster may only get when
        a node joins), up to start_timeout_s (GetTimeoutError). Gives up at once (_NotWanted)
        when the pool's target comes down meanwhile or the cluster stops: the targets are taken
        by the supervisor thread while this one waits."""
        import ray
        from ray.exceptions import GetTimeoutError

        ready, end = pg.ready(), time.monotonic() + self.start_timeout_s
        while not ray.wait([ready], timeout=0.25)[0]:
            if self._stopping.is_set():
                raise _NotWanted("the cluster is stopping")
            have, want = len(self._members(pool)), self.targets.get(pool, 0)
            if have > want:
                raise _NotWanted(f"the pool's target is {want} now (its placement was still waiting for resources)")
            if time.monotonic() > end:
                raise GetTimeoutError(f"no resources for the worker's placement group within {self.start_timeout_s:g} s")
        ray.get(ready)

    def _least_loaded(self, members: list[WorkerRecord]) -> WorkerRecord:
        """The worker with the fewest open requests; among equals the newest (highest index)."""
        import ray

        def busy(w: WorkerRecord) -> int:
            try:
                ld = ray.get(w.actor.load.remote(), timeout=5)
                return ld.running_requests + ld.waiting_requests + ld.transferring_requests
            except Exception:  # no answer: the least useful worker to keep
                return -1
        loads = {w.worker_id: busy(w) for w in members}
        return min(members, key=lambda w: (loads[w.worker_id], -int(w.worker_id.rsplit("-", 1)[1])))

    def _drain(self, victim: WorkerRecord) -> dict:
        """Take `victim` out of every router's placement and empty it: its streams finish (or
        move after drain_grace_s), its pages come back; then the routers forget it.
        {"finished", "moved", "drained_s", "free", "total", "idle"}."""
        import ray

        t0 = time.monotonic()
        victim.state = "draining"
        self._status_seq += 1
        self._push_status()
        refs = [r.actor.retire_worker.remote(victim.worker_id, self.drain_grace_s) for r in self.routers]
        finished = moved = 0
        for r, ref in zip(self.routers, refs):
            try:
                got = ray.get(ref, timeout=self.drain_grace_s + 60)
                finished, moved = finished + got["finished"], moved + got["moved"]
            except Exception as exc:
                log.warning("%s: drain of %s: %s", r.name, victim.worker_id, _first_line(exc))
        drained = time.monotonic() - t0
        free = total = 0
        idle = False
        end = time.monotonic() + 10
        while time.monotonic() < end:  # the cancels of moved requests land between the worker's steps
            try:
                ld = ray.get(victim.actor.load.remote(), timeout=5)
                free, total = ld.free_pages, ld.total_pages
                if free == total and ld.running_requests + ld.waiting_requests + ld.transferring_requests == 0:
                    idle = True
                    break
            except Exception:
                break
            time.sleep(0.05)
        for r in self.routers:
            try:
                ray.get(r.actor.remove_worker.remote(victim.worker_id), timeout=10)
            except Exception as exc:
                log.warning("%s: removing %s: %s", r.name, victim.worker_id, _first_line(exc))
        return {"finished": finished, "moved": moved, "drained_s": drained, "free": free, "total": total, "idle": idle}

    def _stop(self, victim: WorkerRecord, pool: str, why: str) -> None:
        """End a drained worker's actor; its bundle goes back to `pool` (or its own group away)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get(victim.actor.close.remote(), timeout=20)
        except Exception as exc:
            log.warning("close of %s: %s", victim.worker_id, _first_line(exc))
        ray.kill(victim.actor)
        if victim.own_pg:
            try:
                remove_placement_group(victim.pg)
            except Exception:
                pass
            if victim.pg in self._pgs:
                self._pgs.remove(victim.pg)
        elif victim.pg is not None:
            self._free_bundles.setdefault(pool, []).append((victim.pg, victim.bundle))
        victim.state, victim.error, victim.moving_to = "stopped", why, ""
        with self._lock:
            self.workers.remove(victim)
            self._stopped = (self._stopped + [victim])[-8:]
            self._status_seq += 1

    def _scale_in(self, pool: PoolConfig) -> None:
        """Remove the least loaded worker of `pool`: out of every router's placement, its streams
        finish (or move after drain_grace_s), its pages free, then its actor stops."""
        members = [w for w in self._members(pool.name) if w.state == "serving"]
        if not members:
            return
        victim = self._least_loaded(members)
        t0 = time.monotonic()
        d = self._drain(victim)
        self._stop(victim, pool.name, f"scaled in: pages {d['free']}/{d['total']} free when it stopped")
        self._say(f"pool {pool.name}: worker {victim.worker_id} removed: drained in {d['drained_s']:.2f} s "
                  f"({d['finished']} request(s) finished on it, {d['moved']} moved), pages {d['free']}/{d['total']} "
                  f"free, stopped after {time.monotonic() - t0:.2f} s", logging.INFO)

    def _move(self, frm: str, to: str) -> None:
        """Move the least loaded serving worker of pool `frm` to pool `to` without restarting its
        process: drain it as a scale-in does, switch its role in place (HostedWorker.switch_role:
        its weights and KV cache stay, its connector and policies are `to`'s), then warm it up
        and place on it as `to`'s newest worker. A switch that fails stops the worker instead;
        `to` is then short of its target and the scaler starts a new worker there."""
        import ray

        pools = {p.name: p for p in self.config.pools}
        members = [w for w in self._members(frm) if w.state == "serving"]
        if not members:  # nothing to move (all starting or lost): the targets stand, the scaler makes them
            self._say(f"pool {frm}: no serving worker to move to {to}; {to} gets a new worker instead")
            return
        victim = self._least_loaded(members)
        old_id, t0 = victim.worker_id, time.monotonic()
        victim.moving_to = to
        d = self._drain(victim)
        victim.state = "switching"
        self._status_seq += 1
        self._push_status()
        dest = pools[to]
        try:
            if not d["idle"]:
                raise RuntimeError(f"it did not empty within the drain (pages {d['free']}/{d['total']} free)")
            switched = ray.get(victim.actor.call.remote("switch_role", dest.role, dest.engine), timeout=120)
            index = self._next_index[to]
            self._next_index[to] = index + 1
            with self._lock:
                victim.worker_id, victim.pool, victim.role = f"{to}-{index}", to, dest.role
                victim.state = "warming"
                self._status_seq += 1
            self._push_status()
            warm = 0.0
            for r in self.routers:
                warm = max(warm, ray.get(r.actor.add_worker.remote(victim.worker_id, to, dest.role, victim.actor),
                                         timeout=180))
        except Exception as exc:
            why = f"{type(exc).__name__}: {_cause(exc)}"
            for r in self.routers:
                try:
                    ray.get(r.actor.remove_worker.remote(victim.worker_id), timeout=10)
                except Exception:
                    pass
            self._pool_error[to] = f"the move of {old_id} failed ({why}); it stopped, a new worker starts instead"
            self._say(f"pool {to}: {self._pool_error[to]}")
            self._stop(victim, to, f"move to {to} failed: {why}"[:300])
            return
        with self._lock:
            victim.state, victim.moving_to = "serving", ""
            self._status_seq += 1
        self._say(f"worker {old_id} of pool {frm} now serves as {victim.worker_id} of pool {to} ({dest.role}), "
                  f"{time.monotonic() - t0:.1f} s after the move began: drained in {d['drained_s']:.2f} s "
                  f"({d['finished']} request(s) finished on it, {d['moved']} moved), role switched in "
                  f"{switched:.2f} s with its process and weights kept, warm-up {warm:.2f} s", logging.INFO)

    def scale_status(self) -> dict:
        """What the routers show in ClusterStatus (router.service.PoolTargets.status)."""
        with self._lock:
            pools = {p.name: {"target": self.targets.get(p.name, p.replicas),
                              "stamp": self._target_stamp.get(p.name, 0.0),
                              "current": sum(1 for w in self.workers if w.pool == p.name and not w.spare
                                             and w.state == "serving"),
                              "start_failures": self._start_failures.get(p.name, 0),
                              "error": self._pool_error.get(p.name, "")} for p in self.config.pools}
            workers = [{"worker_id": w.worker_id, "pool": w.pool, "role": w.role, "state": w.state, "error": w.error,
                        "moving_to": w.moving_to}
                       for w in [*self._stopped, *self.workers] if w.state != "serving" or w.moving_to]
        return {"pools": pools, "workers": workers}

    def _push_status(self) -> None:
        import ray

        seq, status = self._status_seq, self.scale_status()
        for r in self.routers:
            if r.pushed == seq or r.lost_at is not None:
                continue
            try:
                ray.get(r.actor.scale_status.remote(status), timeout=5)
                r.pushed = seq
            except Exception as exc:
                log.warning("%s: scale status: %s", r.name, _first_line(exc))


class _NotWanted(Exception):
    """A scale-out given up because its worker is no longer wanted (not a failed start)."""


def _cause(exc: BaseException) -> str:
    """The last line of a remote traceback that says what was raised (e.g. the engine's ValueError)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception"))]
    return (said[-1] if said else (lines[-1] if lines else type(exc).__name__))[:500]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
