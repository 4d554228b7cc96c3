"""The non-leader ranks of a tensor-parallel engine (engine/parallel.py), and how the leader
starts them on its own host.

`TPFollower(spec, rank, world, init_method).run()` is one follower: it connects to the group's
TCPStore (the leader hosts it at `init_method`), loads its shard of the model and allocates
its KV heads' cache (and builds its end of the engine's KV connector, if any), says it is
ready, joins the process group and then runs every step (and connector command) the leader
hands it until the leader stops the group (or is gone). It needs no scheduler: the
leader's block pool numbers the pages for every rank. Anything that can run a Python call can
host it: a subprocess (`python -m engine.tp_worker SPEC RANK WORLD INIT_METHOD`, what
`LocalFollowers` starts for `LLM(..., tensor_parallel_size=N)`), or a Ray actor per rank.

Start-up handshake, through the store: a follower sets `tp/ready/RANK` once loaded, or
`tp/error/RANK` with the reason it could not load; the leader waits for every rank's ready
key (`wait_ready`), failing with a follower's reason, or naming a follower that exited.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine.parallel import DEFAULT_TIMEOUT_S, TPGroup, TPGroupError, parse_init_method

log = logging.getLogger(__name__)

READY_KEY = "tp/ready/{rank}"
ERROR_KEY = "tp/error/{rank}"
IDLE_POLL_S = 60.0  # a follower's wait for the next step wakes this often (then waits again)
START_TIMEOUT_S = 600.0


@dataclass(slots=True)
class ShardSpec:
    """What every rank of a group must agree on to run its shard (JSON-able)."""

    model_dir: str
    dtype: str  # 'float32', 'bfloat16', 'float16'
    page_size: int
    num_pages: int
    max_model_len: int
    attention_backend: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    vocab_parallel: bool = False
    transport: str = "gloo"  # CPU all-reduces: "gloo" or "socket" (engine/parallel.py)
    # The engine's KV connector as each follower builds its rank's end of it (None: no
    # connector): {"factory": "module:callable", "settings": {...}}, from the leader's
    # connector's follower_config (engine/kv_connector.py); the engine imports no transport
    kv_connector: dict | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ShardSpec":
        return cls(**json.loads(text))


def connect_store(init_method: str, *, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """A client of the group's store at `init_method`, or (`is_master`) the store itself,
    listening on that host only: TCPStore's own server binds every interface whatever host it is
    given, so the leader binds the socket and hands it over."""
    host, port = parse_init_method(init_method)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the listening socket now
    return store


class TPFollower:
    """One non-leader rank: its shard, its KV cache, and the step loop (module docstring)."""

    def __init__(self, spec: ShardSpec, rank: int, world: int, init_method: str, *,
                 device: str | torch.device = "cpu", num_threads: int | None = None, host: str | None = None) -> None:
        """`host`: the address of this rank's node that gloo binds (default: the leader's, right
        when the follower runs on the leader's host)."""
        if not 0 < rank < world:
            raise ValueError(f"a follower's rank must be in [1, {world}), got {rank}")
        self.spec, self.rank, self.world, self.init_method = spec, rank, world, init_method
        self.device = torch.device(device)
        self.num_threads = num_threads
        self.host = host or parse_init_method(init_method)[0]
        self.group: TPGroup | None = None

    def run(self) -> None:
        """Load, join the group, run steps until the leader stops the group. Raises
        TPGroupError when the leader is lost or a collective fails."""
        from engine.config import ModelConfig
        from engine.model_runner import ModelRunner

        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        spec = self.spec
        store = connect_store(self.init_method, is_master=False, timeout_s=IDLE_POLL_S)
        kv = None
        try:
            cfg = ModelConfig.from_pretrained(spec.model_dir)
            self.group = TPGroup(store, self.rank, self.world, self.device, host=self.host, timeout_s=spec.timeout_s,
                                 transport=spec.transport)
            runner = ModelRunner(
                Path(spec.model_dir), cfg, dtype=getattr(torch, spec.dtype), device=self.device,
                page_size=spec.page_size, num_pages=spec.num_pages, max_model_len=spec.max_model_len,
                attention_backend=spec.attention_backend, tp=self.group, vocab_parallel=spec.vocab_parallel,
            )
            if spec.kv_connector is not None:  # this rank's end of the engine's KV connector
                build = _resolve(spec.kv_connector["factory"])
                kv = build(spec.kv_connector["settings"], rank=self.rank, host=self.host, kv_caches=runner.kv_caches,
                           head_start=runner.shard.kv_head_start, num_kv_heads=cfg.num_kv_heads, store=store,
                           event_store=connect_store(self.init_method, is_master=False, timeout_s=IDLE_POLL_S))
        except Exception as exc:
            store.set(ERROR_KEY.format(rank=self.rank), f"{type(exc).__name__}: {exc}"[:2000])
            raise
        store.set(READY_KEY.format(rank=self.rank), b"ok")
        self.group.connect()
        try:
            while (msg := self.group.recv()) is not None:
                if isinstance(msg, bytes):  # a KV connector command (kv_transfer/tp_connector.py)
                    if kv is None:
                        raise TPGroupError(f"rank {self.rank} got a KV connector command but has no connector")
                    kv.handle(msg)
                elif kv is None:
                    runner.follower_step(msg)
                else:
                    with kv.lock:  # the step's sends start in its forward
                        runner.follower_step(msg, kv.on_layer())
        finally:
            if kv is not None:
                kv.close()
            self.group.close()


# ---- the leader's side -------------------------------------------------------------------------
def wait_ready(store: dist.Store, world: int, liveness: Callable[[], None], timeout_s: float = START_TIMEOUT_S) -> None:
    """Leader: return once ranks 1..world-1 are loaded; raise TPGroupError with a follower's
    reason, or when one exits, or after `timeout_s`."""
    pending = set(range(1, world))
    deadline = time.monotonic() + timeout_s

    def reported_errors() -> None:
        for r in sorted(pending):
            if store.check([ERROR_KEY.format(rank=r)]):
                reason = store.get(ERROR_KEY.format(rank=r)).decode(errors="replace")
                raise TPGroupError(f"tensor-parallel rank {r} could not start: {reason}")

    while pending:
        reported_errors()
        for r in sorted(pending):
            if store.check([READY_KEY.format(rank=r)]):
                pending.discard(r)
        if not pending:
            return
        try:
            liveness()
        except TPGroupError:
            reported_errors()  # a rank that said why before it exited: its reason, not its exit code
            raise
        if time.monotonic() > deadline:
            raise TPGroupError(f"tensor-parallel ranks {sorted(pending)} not ready within {timeout_s:g} s")
        time.sleep(0.02)


class LocalFollowers:
    """Ranks 1..world-1 of a group as subprocesses of the leader's process on this host (what
    `EngineCore(tensor_parallel_size=N)` starts). `check` is the leader's liveness test."""

    def __init__(self, spec: ShardSpec, world: int, init_method: str, devices: list[str], num_threads: int) -> None:
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # an idle follower's store waits time out and retry
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, world):
                cmd = [sys.executable, "-m", "engine.tp_worker", spec.to_json(), str(rank), str(world), init_method,
                       "--device", devices[rank], "--threads", str(num_threads), "--die-with-parent"]
                self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, cwd=root))
        except BaseException:
            self.stop(0)
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                raise TPGroupError(f"tensor-parallel rank {rank} (pid {p.pid}) {how}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` for the followers to leave (after `TPGroup.stop_followers`),
        then kill what is left; reaps them all."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _resolve(path: str):
    """'package.module:name' -> that object (a connector's follower-side factory)."""
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the process that started it dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m engine.tp_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", help="ShardSpec as JSON")
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("init_method", help="tcp://HOST:PORT of the leader's store")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--host", default=None, help="this node's address for gloo (default: the leader's)")
    parser.add_argument("--die-with-parent", action="store_true")
    args = parser.parse_args(argv)
    if args.die_with_parent:
        _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"tp rank {args.rank}: %(levelname)s %(message)s")
    follower = TPFollower(ShardSpec.from_json(args.spec), args.rank, args.world, args.init_method,
                          device=args.device, num_threads=args.threads or None, host=args.host)
    try:
        follower.run()
    except TPGroupError as exc:
        print(f"tp rank {args.rank}: {exc}", file=sys.stderr)
        return 3
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
