"""An engine process (a worker actor, a tensor-parallel follower rank) runs at normal priority
(nice 0) for its whole life, every thread of it, those it makes later too: Ray starts workers
at nice 15, where an engine step yields to anything else on the node (cluster/actors.py).
Without the right to raise it, the process keeps what it has and the log says so once."""
import os
import subprocess
import sys

import pytest

CHECK = """
import logging, os, threading, time
from cluster.node import normal_priority
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
os.nice(15)  # as Ray starts its workers
early = threading.Thread(target=time.sleep, args=(2,))  # a thread Ray made before the build
early.start()
normal_priority()
normal_priority()  # the refusal, if any, is said once
later = threading.Thread(target=time.sleep, args=(1,))  # e.g. the engine loop, a transport's thread
later.start()
time.sleep(0.2)
print(os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, early.native_id),
      os.getpriority(os.PRIO_PROCESS, later.native_id))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs CAP_SYS_NICE (root here and in CI)")
def test_a_worker_runs_at_normal_priority_for_its_whole_life():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["0", "0", "0"], out.stdout + out.stderr
    assert "LOG" not in out.stderr, out.stderr


def test_without_the_right_to_raise_it_the_worker_keeps_its_priority_and_says_so_once():
    code = CHECK.replace("os.nice(15)", "os.nice(15); os.setgid(65534); os.setuid(65534)") \
        if os.geteuid() == 0 else CHECK
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["15", "15", "15"], out.stdout + out.stderr
    said = [line for line in out.stderr.splitlines() if line.startswith("LOG")]
    assert len(said) == 1 and "CAP_SYS_NICE" in said[0] and "nice 15" in said[0], out.stderr
