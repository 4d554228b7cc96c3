"""Keep the gRPC transport's megabyte buffers in the process heap (glibc only).

Every Push message makes a few buffers of about `chunk_bytes` (gRPC's read buffers, the bytes
object it hands to Python). With glibc's defaults such buffers come from fresh mmap()s or
from heap tops trimmed back to the kernel after each free, so every message faults its pages
in again: a 512 MiB transfer cost the receiver ~64k page faults and about a third of its CPU
time (perf: clear_page/exc_page_fault under recvmsg). Raising the mmap threshold above the
message size and the trim threshold to a few messages lets freed buffers be reused, with the
faults gone and ~35% less receiver CPU per byte (bench/kv_bench.py;
docs/notebook/2026-12-03-kv-transfer-runs.md).

The settings are process-wide (mallopt), which is why TransferConfig.grpc_tune_malloc can turn
this off; the memory kept is bounded by the trim threshold per malloc arena.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_lock = threading.Lock()
_applied_mmap = 0


def keep_message_buffers(message_bytes: int) -> bool:
    """Let buffers of up to 2x `message_bytes` (at least 2 MiB) be served and reused from the
    heap; returns whether glibc took the setting. Never lowers an earlier setting."""
    global _applied_mmap
    mmap_threshold = max(2 << 20, 2 * message_bytes)
    with _lock:
        if mmap_threshold <= _applied_mmap:
            return True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False  # not glibc: nothing to tune
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and \
            mallopt(_M_TRIM_THRESHOLD, 8 * mmap_threshold) == 1
        if ok:
            _applied_mmap = mmap_threshold
        else:
            log.warning("mallopt refused the gRPC buffer settings; transfers will fault their buffers in")
        return ok
