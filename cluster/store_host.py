"""The KV store actors (kv_store/, issue 37): one per node of the cluster, pinned to it, hosted
like a worker (`engine.async_worker.AsyncWorker` given a `StoreSpec`), restarted by Ray when its
process is lost (it comes back empty; the routers' index learns so from its new event epoch).

    kv_store.size      bytes of each node's store ("auto": 1/16 of the node's memory, at most
                       4 GiB; 0: no stores)
    page size          the cluster's hash page size (the prefill pool's): what the router's
                       index counts in; a worker of another page size neither offloads nor fetches
    dtype, transport   the decode pools': a store's pages are copied to and from their caches

Nothing here imports Ray or torch at module level.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.config import ClusterConfig
from cluster.node import bind_host, node_address, normal_priority, ucx_net_devices

STORE_MAX_RESTARTS = 10


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """A node's store, built in its actor's process: `spec()` returns the KVStore."""

    model: str
    size: str                 # cluster.config_kv_store size text
    page_size: int
    dtype: str | None
    transport: str
    deadline_s: float
    local: bool = True
    kv_secret: str = field(default="", repr=False)

    @property
    def node(self) -> str:
        return node_address()

    def __call__(self):
        from cluster.config_kv_store import KVStoreSettings
        from kv_store import KVStore
        from kv_transfer.config import TransferConfig

        normal_priority()
        cfg = TransferConfig(host=bind_host(self.local), deadline_s=self.deadline_s, secret=self.kv_secret,
                             ucx_net_devices=ucx_net_devices(self.local))
        return KVStore(self.model, size_bytes=KVStoreSettings(size=self.size).size_bytes(), page_size=self.page_size,
                       dtype=self.dtype, transport=self.transport, transfer_config=cfg)


def store_spec(cfg: ClusterConfig, local: bool, kv_secret: str) -> StoreSpec | None:
    """The spec of every node's store, or None: no store (size 0, or no pool that could use one:
    only colocated pools, or every pool tensor-parallel)."""
    if not cfg.kv_store.enabled:
        return None
    users = [p for p in cfg.pools if p.role != "colocated" and p.engine.tensor_parallel_size == 1]
    if not any(p.role == "decode" for p in users):
        return None
    decode = next(p for p in users if p.role == "decode")
    dtype = decode.engine.dtype or ("bfloat16" if decode.resources.num_gpus else None)
    t = cfg.transport
    return StoreSpec(cfg.model, cfg.kv_store.size, cfg.hash_page_size, dtype, t.kind, t.deadline_s, local, kv_secret)


def launch_stores(cfg: ClusterConfig, local: bool, kv_secret: str) -> list[tuple[str, object]]:
    """One store actor per alive node, launched (not waited for: `await_stores`); [(store id, actor)]."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from engine.async_worker import AsyncWorker

    spec = store_spec(cfg, local, kv_secret)
    if spec is None:
        return []
    nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerAddress"])
    stores = []
    for i, n in enumerate(nodes):
        sid = f"kv-store-{i}"
        opts = dict(num_cpus=cfg.kv_store.num_cpus, max_concurrency=10000, name=f"pdcluster-{sid}",
                    max_restarts=STORE_MAX_RESTARTS,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
        stores.append((sid, ray.remote(AsyncWorker).options(**opts).remote(spec, sid, True)))
    return stores


def await_stores(cfg: ClusterConfig, stores: list[tuple[str, object]], timeout_s: float) -> None:
    """Every store built and answering; RuntimeError (the stores killed) naming the size if not."""
    import ray

    try:
        ray.get([a.ready.remote() for _, a in stores], timeout=timeout_s)
    except Exception as exc:
        for _, a in stores:
            ray.kill(a)
        raise RuntimeError(f"the KV stores could not start (kv_store.size {cfg.kv_store.size!r}): "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
