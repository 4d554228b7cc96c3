"""A tensor-parallel worker on Ray: one worker is one group. Its placement group has one bundle
per rank (`resources` per rank, strategy `resources.tp_placement`); the worker's own actor, the
leader (rank 0: scheduler, sampler, the router's handle), runs in bundle 0 and starts one
`FollowerActor` per other rank in bundles 1..N-1. Each follower actor runs
`engine.tp_worker.TPFollower.run()` in a thread and answers `info()` meanwhile.

`RayFollowers` is the engine's `tp_launcher` (EngineCore._start_tensor_parallel):
`check()` raises TPGroupError once a follower's actor died or its run ended (a `ray.wait` with
timeout 0 on the runs: it never blocks), `stop()` kills the follower actors, `pids`/`nodes`
say where the ranks run. The follower actors are owned by the leader's process: Ray kills them
with it, and `stop()` kills them first when the leader gives the group up (cluster.actors).

Followers bind loopback in a local cluster, their node's address on a real one (as the
leader's `tp_host`, cluster.node.bind_host). Nothing here imports Ray or torch at module level.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a follower actor's process up and answering info()


class FollowerActor:
    """One rank 1..N-1 of a worker's tensor-parallel group, in its own bundle (a threaded actor:
    `run` occupies one thread for the group's life, `info` answers on the other)."""

    def __init__(self, local: bool, num_threads: int) -> None:
        from cluster.node import bind_host, node_address, normal_priority

        normal_priority()
        self.host = bind_host(local)
        self.node = node_address()
        self.num_threads = num_threads

    def info(self) -> dict:
        return {"pid": os.getpid(), "node": self.node, "threads": self.num_threads}

    def run(self, spec_json: str, rank: int, world: int, init_method: str, device: str) -> int:
        from engine.tp_worker import ShardSpec, TPFollower

        if device.startswith("cuda"):  # Ray gives this actor its bundle's GPU as its only visible device
            device = "cuda"
        logging.basicConfig(level=logging.WARNING, format=f"tp rank {rank}: %(levelname)s %(message)s")
        TPFollower(ShardSpec.from_json(spec_json), rank, world, init_method, device=device,
                   num_threads=self.num_threads, host=self.host).run()
        return os.getpid()


class RayFollowers:
    """The `tp_launcher` of a worker's engine on Ray (module docstring). Build it with
    `RayFollowers.launcher(...)`, which fixes the Ray side and returns the engine's callable."""

    def __init__(self, spec, world: int, init_method: str, devices: list[str], *, placement_group,
                 resources: dict, local: bool, num_threads: int, name: str = "worker") -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world, self.name = world, name
        self.lost: str | None = None
        self.actors: list[Any] = []
        self.runs: list[Any] = []
        cls = ray.remote(FollowerActor)
        try:
            for rank in range(1, world):
                strategy = PlacementGroupSchedulingStrategy(placement_group=placement_group,
                                                            placement_group_bundle_index=rank)
                opts = dict(num_cpus=resources.get("num_cpus", 0), num_gpus=resources.get("num_gpus", 0),
                            resources=resources.get("custom") or None, scheduling_strategy=strategy,
                            max_concurrency=2, max_restarts=0) if placement_group is not None else \
                    dict(num_cpus=0, max_concurrency=2, max_restarts=0)
                actor = cls.options(**opts).remote(local, num_threads)
                self.actors.append(actor)
                self.runs.append(actor.run.remote(spec.to_json(), rank, world, init_method, devices[rank]))
            self._infos = [a.info.remote() for a in self.actors]
        except BaseException:
            self.stop(0)
            raise
        self._info: list[dict] | None = None

    @classmethod
    def launcher(cls, *, resources: dict, local: bool, num_threads: int, name: str):
        """The engine's `tp_launcher(spec, world, init_method, devices, num_threads)`: followers
        in this actor's placement group (bundle r for rank r), each with `num_threads` torch
        threads (its own bundle's whole CPUs: the engine's share of the leader's count is ignored)."""
        import ray

        pg = ray.util.get_current_placement_group()

        def launch(spec, world, init_method, devices, _num_threads):
            return cls(spec, world, init_method, devices, placement_group=pg, resources=resources, local=local,
                       num_threads=num_threads, name=name)
        return launch

    # ---- what the engine asks -------------------------------------------------------------
    def check(self) -> None:
        """Raise TPGroupError once a follower's actor is gone or its run ended; never blocks."""
        from engine.parallel import TPGroupError

        if self.lost is not None:
            raise TPGroupError(self.lost)
        import ray

        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0, fetch_local=False)
        if not done:
            return
        rank = self.runs.index(done[0]) + 1
        where = self._where(rank)
        try:
            ray.get(done[0], timeout=5)
            why = "left the group"
        except ray.exceptions.RayActorError as exc:
            why = f"was lost (its actor died: {_first_line(exc)})"
        except Exception as exc:
            why = f"failed: {_first_line(exc)}"
        self.lost = f"tensor-parallel rank {rank}{where} of {self.name} {why}"
        raise TPGroupError(self.lost)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Give the followers `timeout_s` to leave (after TPGroup.stop_followers), then kill their
        actors (and processes): none outlives its group."""
        import ray

        if self.runs and timeout_s > 0:
            try:
                ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s, fetch_local=False)
            except Exception:
                pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception as exc:
                log.warning("%s: killing a tensor-parallel follower: %s", self.name, _first_line(exc))
        if self.lost is None:
            self.lost = f"the tensor-parallel followers of {self.name} were stopped"

    @property
    def info(self) -> list[dict]:
        """pid, node and threads of ranks 1..N-1 (asked once; blocks until their actors answer)."""
        if self._info is None:
            import ray

            deadline = time.monotonic() + START_TIMEOUT_S
            self._info = ray.get(self._infos, timeout=max(deadline - time.monotonic(), 1))
        return self._info

    @property
    def pids(self) -> list[int]:
        return [i["pid"] for i in self.info]

    @property
    def nodes(self) -> list[str]:
        return [i["node"] for i in self.info]

    def _where(self, rank: int) -> str:
        if self._info is None:
            return ""
        i = self._info[rank - 1]
        return f" (pid {i['pid']} on {i['node']})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
