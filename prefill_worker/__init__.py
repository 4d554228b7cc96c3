"""Prefill pool worker: an engine with a sending KV connector; it runs each request to its first
token and sends the prompt's KV layer by layer. May import engine and kv_transfer; never Ray or
router. Importing the package loads only the boundary types (`PrefillWorker` is loaded on use).
"""
from prefill_worker.types import PrefillResult, PrefillTask

__all__ = ["PrefillResult", "PrefillTask", "PrefillWorker"]


def __getattr__(name: str):
    if name == "PrefillWorker":
        from prefill_worker.worker import PrefillWorker

        return PrefillWorker
    raise AttributeError(name)
