"""Prefill pool worker: batches and chunks prefills, reuses prefix-cached pages, samples the
first token and sends KV layer by layer. May import engine and kv_transfer; never Ray or router.
"""
from prefill_worker.async_worker import AsyncPrefillWorker
from prefill_worker.tasks import PrefillLoad, PrefillResult, PrefillTask
from prefill_worker.worker import PrefillWorker, engine_kv_pool, set_worker_threads

__all__ = ["AsyncPrefillWorker", "PrefillLoad", "PrefillResult", "PrefillTask", "PrefillWorker", "engine_kv_pool", "set_worker_threads"]
