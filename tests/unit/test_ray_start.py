"""A failed Ray start leaves nothing behind (cluster/ray_start.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cluster.ray_start import kill_ray_children, ray_children


def test_leftover_ray_processes_are_found_and_killed():
    # stand-ins for what a failed ray.init leaves: children whose command lines name Ray's daemons
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", name])
             for name in ("gcs_server", "raylet")]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "not-ray"])
    try:
        assert {p.pid for p in procs} <= set(ray_children())
        assert kill_ray_children() >= 2
        assert all(not Path(f"/proc/{p.pid}").exists() for p in procs)  # killed and reaped
        assert other.poll() is None  # only Ray's processes
    finally:
        for p in (*procs, other):
            p.kill()
            p.wait()
