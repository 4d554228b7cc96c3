"""Decode pool worker: an engine with a receiving KV connector (or none, colocated), plus the
decode policies: decode-first admission with page reservation, the local-prefill decision and
the transfer-failure policy. May import engine and kv_transfer; never Ray or router. Importing
the package loads only the boundary types (`DecodeWorker` is loaded on use).
"""
from decode_worker.types import (Admission, DecodeConfig, DecodeOutput, DecodeStage, TokenSource,
                                 TransferFailurePolicy)

__all__ = ["Admission", "DecodeConfig", "DecodeOutput", "DecodeStage", "DecodeWorker", "TokenSource",
           "TransferFailurePolicy"]


def __getattr__(name: str):
    if name == "DecodeWorker":
        from decode_worker.worker import DecodeWorker

        return DecodeWorker
    raise AttributeError(name)
