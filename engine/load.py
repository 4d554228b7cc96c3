"""`WorkerLoad`: what one worker reports about itself, the same type for every role (prefill,
decode, colocated). The router places requests by it, its metrics and `ClusterStatus` show it.
No torch here: it crosses into the router's process.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.heap import GcPauseStats


@dataclass(slots=True)
class WorkerLoad:
    running_requests: int = 0      # in the engine's running batch
    waiting_requests: int = 0      # anywhere short of running: engine queue, queued for pages, waiting for KV
    queued_tokens: int = 0         # prompt tokens still to compute of waiting requests
    running_tokens: int = 0        # prompt tokens still to compute of running requests (chunked prefills)
    transferring_requests: int = 0  # KV transfers in flight: prefill sending, decode waiting for KV
    free_pages: int = 0            # KV pages neither in use nor held for a transfer
    total_pages: int = 0
    tokens_per_s: float = 0.0      # tokens generated per second over the last few seconds
    prefix_cache_hit_rate: float = 0.0  # cached pages / pages looked up, 0..1
    prefix_cache_queries: int = 0
    num_preemptions: int = 0
    queued_for_pages: int = 0      # decode: admitted, waiting for pages to receive KV into
    waiting_for_kv: int = 0        # decode: pages allocated, KV not arrived yet
    num_local_prefills: int = 0    # decode: prompts prefilled here instead of transferred
    local_prefill_threshold: int = 0  # decode: a prompt with fewer uncached tokens here is prefilled here (0: never)
    num_reprefills: int = 0        # decode: failed transfers prefilled here instead
    gc: GcPauseStats | None = None  # the worker process's garbage collections (its host sets it)
    pid: int = 0                   # the worker's process (its host sets it): a new one means a restart
    node: str = ""                 # the address of the node it runs on ("" in process)
