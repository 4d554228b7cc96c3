"""What the simulator simulates: pools of workers (role, replicas, step times, engine limits,
hardware) and the cluster-wide serving figures (router limits, placement policy, the serving
path's delays and the interference of workers sharing a host). `sim_config.py` builds these
from a cluster YAML and a profile; `simulator.py` runs them."""
from __future__ import annotations

from dataclasses import dataclass, field

from planning.latency import LatencyModel
from planning.sim_request import EngineLimits
from router.policy import POLICIES

ROLES = ("prefill", "decode", "colocated")


@dataclass(slots=True)
class SimPool:
    name: str
    role: str
    replicas: int
    latency: LatencyModel
    limits: EngineLimits = field(default_factory=EngineLimits)
    local_prefill_threshold: int = 0
    reserve_pages: int = 0
    hardware: str = "cpu"            # what one replica runs on (for reports and costs)
    host: str = ""                   # replicas of pools with the same non-empty host share its cores
    gpus_per_replica: int = 0
    price_per_hour: float = 0.0      # per replica
    tp: int = 1                      # ranks whose per-rank KV (latency.kv_bytes_per_token) makes one page

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"pool {self.name}: role must be one of {ROLES}, got {self.role!r}")
        if self.replicas < 1:
            raise ValueError(f"pool {self.name}: replicas must be >= 1, got {self.replicas}")


@dataclass(slots=True)
class SimCluster:
    pools: list[SimPool]
    policy: str = "prefix-aware"
    max_inflight: int = 64
    max_queue: int = 256
    transport: str = "nixl"
    first_token_delay_s: float = 0.0   # router and network time of every chunk on its way to the client
    kv_handoff_s: float = 0.0          # transfer done -> the decode worker holds it (notice, polling)
    host_interference: float = 0.0     # step time x (1 + this x other workers prefilling on the same host)
    busy_admit_s: float = 0.0          # a decode worker admits between steps; this much later while it steps
    load_base: float = 0.0             # a decode step x (1 + this) under load, before the per-stream terms
    load_same: float = 0.0             # step time x (1 + this x decoding sequences past the first), under load
    load_other: float = 0.0            # step time x (1 + this x sequences decoding on other workers of the host)
    load_other_prefill: float | None = None  # the same for a step that prefills (None: load_other)
    exact_steps: bool = False  # every decode step its own event (planning/simulator.py); same records, slower
    hash_page_size: int = 0            # the router's block hashes (0: the first prefill/colocated pool's pages)
    kv_store_bytes: int = 0            # each node's KV store (sim_store.py; 0: no store tier)
    fetch_min_pages: int = 0           # router.fetch_min_pages: > 0 lets a prefill worker fetch from peers too
    fetch_overhead_s: float | None = None  # a fetch's fixed cost (None: router.fetch_rule's default)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        roles = {p.role for p in self.pools}
        if not roles & {"decode", "colocated"}:
            raise ValueError("a cluster needs a decode or colocated pool")
        if ("prefill" in roles) != ("decode" in roles):
            raise ValueError("prefill and decode pools come together (or use a colocated pool)")
        if not self.hash_page_size:
            self.hash_page_size = next(p.limits.page_size for p in self.pools if p.role != "decode")
        if self.kv_store_bytes < 0 or self.fetch_min_pages < 0:
            raise ValueError(f"kv_store_bytes and fetch_min_pages must be >= 0, got {self.kv_store_bytes}, "
                             f"{self.fetch_min_pages}")
        if self.max_inflight < 1 or self.max_queue < 0:
            raise ValueError(f"max_inflight must be >= 1 and max_queue >= 0, got {self.max_inflight}, {self.max_queue}")

    @property
    def mode(self) -> str:
        return "colocated" if all(p.role == "colocated" for p in self.pools) else "disaggregated"

    def describe(self) -> str:
        return " + ".join(f"{p.replicas}x{p.role[0].upper()}[{p.hardware}]" for p in self.pools)
