"""The KV store tier: one per node, below the workers' prefix caches (kv_store/store.py)."""
from kv_store.store import KVStore

__all__ = ["KVStore"]
