"""A `SimCluster` from the cluster config `serve` reads, with a latency model per pool.

Where a pool's step times come from, first match wins:
  1. a profile given for that pool by name (`pool_profiles`), measured on its hardware;
  2. the pool's `resources.accelerator_type` naming a known GPU, with a model shape: the
     roofline of that model on that GPU (tensor parallelism from the pool's engine settings);
  3. the default profile (`profile`), e.g. this machine's CPU.
Pages per replica follow the engine: `engine.num_pages` when set; otherwise on a GPU, what its
memory holds after the weights (at `gpu_memory_utilization`), and on a CPU profile, the
engine's own default (its KV byte budget, capped at max_model_len x max_num_seqs).

The KV store tier (sim_store.py) takes `kv_store.size` per node: "auto" is 1/16 of the node's
memory, at most 4 GiB, where a node is this machine for pools a profile of it times, and a GPU
server (`GPU_NODE_MEMORY`, so 4 GiB) for pools on a GPU.
"""
from __future__ import annotations

from dataclasses import replace

from cluster.config import ClusterConfig, PoolConfig
from cluster.config_kv_store import KVStoreSettings, node_memory_bytes
from planning.hardware import GPUSpec, get_gpu
from planning.latency import LatencyModel
from planning.roofline import ModelShape, kv_bytes_per_token, roofline_latency_model, weight_bytes
from planning.sim_request import EngineLimits
from planning.sim_spec import SimCluster, SimPool

DEFAULT_MAX_MODEL_LEN = 8192
GPU_NODE_MEMORY = 1 << 40   # host memory taken for a GPU server ("auto" store: 4 GiB from 64 GiB up)


def gpu_num_pages(shape: ModelShape, gpu: GPUSpec, tp: int, page_size: int, utilization: float = 0.9,
                  dtype_bytes: int = 2) -> int:
    """Pages of `page_size` tokens one TP group's memory holds after the weights."""
    free = gpu.memory_bytes * tp * utilization - weight_bytes(shape, dtype_bytes)
    per_page = kv_bytes_per_token(shape, dtype_bytes) * page_size
    pages = int(free // per_page)
    if pages < 1:
        raise ValueError(f"{shape} does not fit on {tp}x {gpu.name}: weights take "
                         f"{weight_bytes(shape, dtype_bytes) / 1e9:.1f} GB of {gpu.memory_bytes * tp * utilization / 1e9:.1f}")
    return pages


def cpu_num_pages(latency: LatencyModel, page_size: int, max_model_len: int, max_num_seqs: int) -> int:
    from engine.core import DEFAULT_KV_CACHE_BYTES

    if latency.kv_bytes_per_token < 1:
        raise ValueError(f"latency model {latency.source!r} has no kv_bytes_per_token: set the pool's num_pages")
    wanted = -(-max_model_len // page_size) * max_num_seqs
    return max(1, min(DEFAULT_KV_CACHE_BYTES // (latency.kv_bytes_per_token * page_size), wanted))


def sim_pool(pool: PoolConfig, *, profile: LatencyModel | None = None, pool_profile: LatencyModel | None = None,
             shape: ModelShape | None = None, max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> SimPool:
    eng = pool.engine
    accel = pool.resources.accelerator_type
    gpu = None
    if pool_profile is not None:
        latency, hardware = pool_profile, pool_profile.source or "profile"
    elif accel and shape is not None:
        gpu = get_gpu(accel)
        tp = eng.tensor_parallel_size
        latency = roofline_latency_model(shape, gpu, tp, max_batched_tokens=eng.max_num_batched_tokens)
        hardware = f"{tp}x{gpu.name}" if tp > 1 else gpu.name
    elif profile is not None:
        latency, hardware = profile, profile.source or "profile"
    else:
        raise ValueError(f"pool {pool.name}: no latency model: give a profile, or a model shape and "
                         f"resources.accelerator_type naming a GPU")
    if eng.num_pages is not None:
        pages = eng.num_pages
    elif gpu is not None:
        pages = gpu_num_pages(shape, gpu, eng.tensor_parallel_size, eng.page_size)
    else:
        pages = cpu_num_pages(latency, eng.page_size, eng.max_model_len or max_model_len, eng.max_num_seqs)
    limits = EngineLimits(eng.page_size, pages, eng.max_num_batched_tokens, eng.max_num_seqs)
    return SimPool(pool.name, pool.role, pool.replicas, replace(latency, max_batched_tokens=eng.max_num_batched_tokens),
                   limits, local_prefill_threshold=eng.local_prefill_threshold, reserve_pages=eng.reserve_pages,
                   hardware=hardware, tp=eng.tensor_parallel_size if gpu else 1,
                   gpus_per_replica=int(pool.resources.num_gpus) or (eng.tensor_parallel_size if gpu else 0),
                   price_per_hour=(gpu.price_per_hour * eng.tensor_parallel_size) if gpu else 0.0)


def sim_cluster(cfg: ClusterConfig, *, profile: LatencyModel | None = None,
                pool_profiles: dict[str, LatencyModel] | None = None, shape: ModelShape | None = None,
                max_model_len: int = DEFAULT_MAX_MODEL_LEN, kv_store_size: str | None = None) -> SimCluster:
    """The serving path's figures (first-token delay, KV hand-off, interference of workers
    sharing this machine) come from the profile's `meta` when it was calibrated on a served
    cluster (serving_profile.py), else 0. Pools timed by a profile of this machine are taken to
    share one host (a local cluster); GPU pools have their own devices. `kv_store_size`: overrides
    the config's `kv_store.size` (the same forms)."""
    pool_profiles = pool_profiles or {}
    unknown = set(pool_profiles) - {p.name for p in cfg.pools}
    if unknown:
        raise ValueError(f"pool profiles name unknown pools {sorted(unknown)}; pools: {[p.name for p in cfg.pools]}")
    pools = [sim_pool(p, profile=profile, pool_profile=pool_profiles.get(p.name), shape=shape,
                      max_model_len=cfg.max_model_len or max_model_len) for p in cfg.pools]
    meta = (profile.meta if profile is not None else {}) or {}
    for pool in pools:
        if not pool.gpus_per_replica:
            pool.host = "localhost"
    store = cfg.kv_store if kv_store_size is None else KVStoreSettings(size=kv_store_size)
    local = any(p.host == "localhost" for p in pools)
    store_bytes = store.size_bytes(node_memory_bytes() if local else GPU_NODE_MEMORY)
    return SimCluster(pools, policy=cfg.router.policy, max_inflight=cfg.router.max_inflight,
                      max_queue=cfg.router.max_queue, transport=cfg.transport.kind,
                      first_token_delay_s=meta.get("first_token_delay_s", 0.0),
                      kv_handoff_s=meta.get("kv_handoff_s", 0.0), host_interference=meta.get("host_interference", 0.0),
                      busy_admit_s=meta.get("busy_admit_s", 0.0), load_base=meta.get("load_base", 0.0),
                      load_same=meta.get("load_same", 0.0),
                      load_other=meta.get("load_other", 0.0), load_other_prefill=meta.get("load_other_prefill"),
                      kv_store_bytes=store_bytes, fetch_min_pages=cfg.router.fetch_min_pages)
