"""A worker is built at normal priority, then every thread of its process goes back to Ray's
worker niceness: a restarted worker's start-up must not crawl behind the serving workers that
took over its streams (cluster/actors.py)."""
import os
import subprocess
import sys

import pytest

CHECK = """
import os, threading, time
from cluster.actors import _start_up_priority
os.nice(15)  # as Ray starts its workers
with _start_up_priority():
    during = os.getpriority(os.PRIO_PROCESS, 0)
    t = threading.Thread(target=time.sleep, args=(1,))  # e.g. a transport's progress thread
    t.start()
    thread_during = os.getpriority(os.PRIO_PROCESS, t.native_id)
print(during, thread_during, os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, t.native_id))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs CAP_SYS_NICE (root here and in CI)")
def test_a_worker_starts_at_normal_priority_and_then_runs_at_rays():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["0", "0", "15", "15"], out.stdout + out.stderr


def test_without_the_right_to_raise_it_the_worker_starts_as_it_is():
    code = CHECK.replace("os.nice(15)", "os.nice(15); os.setgid(65534); os.setuid(65534)") \
        if os.geteuid() == 0 else CHECK
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["15", "15", "15", "15"], out.stdout + out.stderr
