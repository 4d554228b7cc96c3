"""Decode pool worker: preallocates destination pages, waits for KV, runs the continuous decode
batch and streams tokens. May import engine and kv_transfer; never Ray or router.
"""
from decode_worker.async_worker import AsyncDecodeWorker
from decode_worker.types import (Admission, DecodeConfig, DecodeLoad, DecodeOutput, StepResult, TokenSource,
                                 TransferFailurePolicy)
from decode_worker.worker import DecodeStage, DecodeWorker

__all__ = ["Admission", "AsyncDecodeWorker", "DecodeConfig", "DecodeLoad", "DecodeOutput", "DecodeStage", "DecodeWorker", "StepResult",
           "TokenSource", "TransferFailurePolicy"]
