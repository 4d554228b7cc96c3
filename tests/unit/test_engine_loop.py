"""engine.loop: the engine thread runs with the process's intra-op thread count, in OpenMP too
(oneDNN reads OpenMP's per-thread setting, which a new thread does not inherit)."""
from __future__ import annotations

import asyncio
import ctypes
import os

import pytest
import torch

from engine.loop import EngineLoop


def _openmp_max_threads() -> int:
    """omp_get_max_threads() of the OpenMP runtime torch loaded, for the calling thread."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    if not libs:
        pytest.skip("no OpenMP runtime loaded by this torch build")
    return ctypes.CDLL(sorted(libs)[0]).omp_get_max_threads()


class _Idle:
    """A worker with nothing to do (this test only asks about the thread itself)."""

    has_work = False

    class core:
        @staticmethod
        def set_wakeup(fn) -> None:
            pass

    def close(self) -> None:
        pass


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: a new thread's OpenMP default is already 1")
def test_engine_thread_uses_the_process_thread_count():
    assert torch.get_num_threads() == 1  # tests/conftest.py
    torch.zeros(4).add_(1)  # make sure OpenMP is loaded
    loop = EngineLoop(_Idle(), name="test-engine")
    try:
        assert asyncio.run(loop.run(_openmp_max_threads)) == 1
    finally:
        loop.close()
