"""Starting the embedded one-node Ray cluster, and cleaning up after a start that failed.

`ray.init` on a heavily loaded machine can give up waiting for its raylet ("The current node
timed out during startup": Ray waits a fixed 30 s). It then raises before it records the node,
so `ray.shutdown()` does not know the GCS server and raylet it spawned, and they outlive the
caller. `init_local` kills what that failed start left (this process's Ray children, by PID),
and tries once more.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

log = logging.getLogger(__name__)

_RAY_PROCESS_MARKS = ("gcs_server", "raylet", "ray::", "default_worker", "ray/_private", "ray/dashboard")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def command_line(pid: int) -> str | None:
    """A process's command line, its arguments joined by spaces (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def children_matching(marks: tuple[str, ...]) -> list[int]:
    """PIDs of this process's descendants whose command line contains one of `marks`."""
    return [pid for pid in descendants(os.getpid())
            if any(mark in (command_line(pid) or "") for mark in marks)]


def ray_children() -> list[int]:
    """PIDs of this process's descendants that Ray started."""
    return children_matching(_RAY_PROCESS_MARKS)


def kill_ray_children(timeout_s: float = 10.0) -> int:
    """SIGKILL this process's Ray children and reap those that are its own; returns how many."""
    pids = ray_children()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    break
            except ChildProcessError:  # not our child (a grandchild): gone once /proc says so
                if not os.path.exists(f"/proc/{pid}") or _is_zombie(pid):
                    break
            time.sleep(0.01)
    return len(pids)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def init_local(attempts: int = 2, **kwargs: Any) -> None:
    """`ray.init(**kwargs)` for a cluster this process starts; a start that fails leaves no
    Ray process behind, and is tried `attempts` times in all."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as exc:
            try:
                ray.shutdown()
            finally:
                killed = kill_ray_children()
            if attempt == attempts:
                raise
            log.warning("starting Ray failed (%s); %d leftover Ray processes killed, trying again",
                        str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__, killed)
