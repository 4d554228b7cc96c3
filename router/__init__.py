"""gRPC front door: validation, tokenization, placement policies, admission, streaming.
Imports the workers' boundary types (decode_worker.types, prefill_worker.types) and the
engine's light public modules (sampling params, block hashes, loads, checkpoint lookup),
never torch, the model code or a worker: the router's process stays small (import-linter
contracts in pyproject.toml; tests/unit/test_router_imports.py).
"""
