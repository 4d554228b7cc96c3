"""The cluster config, as users write it (YAML) and as `pdcluster serve` builds it from flags.

    model: small                      # checkpoint folder or built-in name
    transport: {kind: nixl, deadline_s: 30, begin_timeout_s: 300}
    router: {host: 127.0.0.1, port: 50051, policy: prefix-aware, max_inflight: 64, max_queue: 256}
    pools:
      - {name: prefill, role: prefill, replicas: 1, resources: {num_cpus: 1}, engine: {page_size: 16}}
      - {name: decode,  role: decode,  replicas: 1, resources: {num_cpus: 1}, engine: {page_size: 16}}

A pool is a role plus a resource shape per replica plus engine settings; heterogeneous pools
are pools with different shapes. `colocated` pools prefill and decode on the same worker.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

from cluster.config_autoscale import AutoscalePool, AutoscaleSettings, SloSettings  # noqa: F401 (re-exported)
from cluster.config_base import Strict as _Strict
from cluster.config_kv_store import KVStoreSettings
from router.policy import POLICIES




class ResourceShape(_Strict):
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved for each replica (each rank of a "
                                                   "tensor-parallel replica); fractions allowed; its whole CPUs, at "
                                                   "least 1, are the torch threads of the replica (of each rank)")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs reserved for each replica (each rank of a "
                                                   "tensor-parallel replica); 0 asks for none")
    accelerator_type: str | None = Field(None, description="Ray accelerator type each replica must run on, e.g. "
                                                           "H100 or A10G; null: any node")
    custom: dict[str, float] = Field(default_factory=dict,
                                     description="extra custom Ray resources per replica, name to amount (e.g. "
                                                 "{prefill_node: 1}), to pin a pool to nodes that offer them")
    tp_placement: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="placement strategy of a tensor-parallel replica's own placement group (one "
                                   "bundle of these resources per rank, rank 0 in bundle 0): STRICT_PACK keeps its "
                                   "ranks on one node, PACK prefers that, SPREAD prefers distinct nodes, "
                                   "STRICT_SPREAD requires them; ignored at tensor_parallel_size 1")

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.num_cpus, **self.custom}
        if self.num_gpus:
            b["GPU"] = self.num_gpus
        if self.accelerator_type:
            b[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return {k: v for k, v in b.items() if v}

    @property
    def threads(self) -> int:
        """torch intra-op threads of one rank: its reserved whole CPUs, at least 1."""
        return max(1, int(self.num_cpus))

    def follower_options(self) -> dict:
        """Ray resources of a tensor-parallel follower rank's actor (the rest of its bundle)."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                "custom": {k: v for k, v in self.bundle().items() if k not in ("CPU", "GPU")}}


class EngineSettings(_Strict):
    tensor_parallel_size: int = Field(1, ge=1, le=64,
                                      description="tensor-parallel degree of one replica: its ranks split the model's "
                                                  "attention heads (it must divide them) and MLP, each rank in its "
                                                  "own bundle of the replica's placement group with the pool's "
                                                  "resources; the router sees one worker, and losing any rank loses "
                                                  "the worker; > 1 needs role colocated until the KV connectors "
                                                  "support it")
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV cache page; prefix-aware routing hashes "
                                                          "prompt blocks at the prefill pool's page size")
    num_pages: int | None = Field(None, ge=1, description="KV cache size of one replica, in pages; null: derived "
                                                          "from the engine's default KV memory budget, capped at "
                                                          "max_num_seqs sequences of max_model_len tokens")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one engine step (one token per "
                                                                "decoding sequence plus prefill chunks); longer "
                                                                "prompts are prefilled in chunks")
    max_num_seqs: int = Field(64, ge=1, description="most sequences one replica runs in its batch at a time")
    max_model_len: int | None = Field(None, ge=2, description="longest sequence (prompt plus generated tokens), in "
                                                              "tokens; null: the model's max_position_embeddings; "
                                                              "the router enforces the smallest value of all pools")
    dtype: str | None = Field(None, description="weights and KV cache dtype: float32, bfloat16 or float16 (also "
                                                "fp32, bf16, fp16); null: float32 on CPU, bfloat16 on GPU; "
                                                "checked when the worker starts")
    attention_backend: Literal["auto", "cpu", "torch", "flashinfer"] = Field(
        "auto", description="attention kernels; auto: flashinfer on CUDA where installed, the compiled CPU kernel "
                            "on CPUs, else torch; the other values force one")
    local_prefill_threshold: int = Field(0, ge=0, description="decode pools: a prompt with fewer uncached tokens "
                                                              "than this is prefilled on the decode worker, without "
                                                              "a transfer; 0: never; ignored by other roles")
    reserve_pages: int = Field(0, ge=0, description="decode pools: KV pages kept free for the running batch when "
                                                    "admitting a transferred prompt; prompts that do not fit wait "
                                                    "in a FIFO queue")
    on_transfer_failure: Literal["fail", "reprefill"] = Field(
        "fail", description="decode pools: what a failed KV transfer (deadline, lost prefill worker, refusal) "
                            "does; fail: the request ends with finish_reason error; reprefill: the decode worker "
                            "prefills it itself")

    def engine_kwargs(self) -> dict:
        kw = dict(tensor_parallel_size=self.tensor_parallel_size, page_size=self.page_size,
                  max_num_batched_tokens=self.max_num_batched_tokens,
                  max_num_seqs=self.max_num_seqs, attention_backend=self.attention_backend)
        for name in ("num_pages", "max_model_len", "dtype"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return kw


class PoolConfig(_Strict):
    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9-]{0,39}$",
                      description="pool name, unique in the config: up to 40 lowercase letters, digits and "
                                  "hyphens, not starting with a hyphen; workers are named NAME-INDEX")
    role: Literal["prefill", "decode", "colocated"] = Field(
        ..., description="prefill: builds prompts' KV and sends it to a decode pool; decode: receives the KV and "
                         "generates; colocated: does both on one worker, with no transfer")
    replicas: int = Field(1, ge=1, le=256, description="number of workers in the pool")
    resources: ResourceShape = Field(default_factory=ResourceShape,
                                     description="Ray resources reserved for each replica")
    engine: EngineSettings = Field(default_factory=EngineSettings,
                                   description="engine settings of every replica in the pool")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement group strategy for the pool (one bundle per replica): PACK prefers few "
                            "nodes, SPREAD distinct nodes; STRICT_PACK requires one node, STRICT_SPREAD a "
                            "different node per replica")
    max_restarts: int = Field(10, ge=0, le=1000,
                              description="how often Ray restarts a lost worker of the pool (a killed process, a lost "
                                          "node) in its placement group bundle before giving it up as dead; the router "
                                          "warms a restarted worker up before placing on it again; 0: never")
    spare_replicas: int = Field(0, ge=0, le=64,
                                description="hot spares beside `replicas`: loaded and warmed up but not placed on; "
                                            "one takes a lost or unresponsive worker's place at once (its streams "
                                            "migrate to the pool's serving workers), and the replaced worker becomes "
                                            "a spare when it is back")


class TransportSettings(_Strict):
    kind: Literal["nixl", "grpc"] = Field(
        "nixl", description="how KV moves from prefill to decode workers: nixl (NIXL over UCX, RDMA where the "
                            "network has it) or grpc (chunked gRPC streams); colocated pools transfer nothing")
    deadline_s: float = Field(30.0, gt=0, description="seconds the whole KV transfer of one request may take, "
                                                      "counted from the start of the send; one still running "
                                                      "then fails")
    begin_timeout_s: float = Field(300.0, gt=0, description="seconds a decode worker's reserved pages wait for "
                                                            "the prefill to start sending (covers queueing in the "
                                                            "prefill pool)")


class RouterSettings(_Strict):
    host: str = Field("127.0.0.1", description="address the router's gRPC server binds to; 0.0.0.0 listens on "
                                                "every interface")
    port: int = Field(50051, ge=0, le=65535, description="TCP port of the router's gRPC server; 0 picks a free port")
    policy: Literal["round-robin", "least-loaded", "prefix-aware"] = Field(
        "prefix-aware", description="request placement; round-robin: in turn, ignoring load; least-loaded: decode "
                                    "worker with fewest requests in flight, prefill worker with fewest queued "
                                    "tokens; prefix-aware: prefill worker believed to cache the longest prompt "
                                    "prefix, decode as least-loaded")
    max_inflight: int = Field(64, ge=1, description="requests running at once across all pools; more wait in the "
                                                    "admission queue")
    max_queue: int = Field(256, ge=0, description="requests that may wait for a running slot; beyond that a new "
                                                  "request is refused with RESOURCE_EXHAUSTED; 0: no waiting")
    max_prefill_attempts: int = Field(2, ge=1, le=8, description="prefill tries per request, each on a different "
                                                                 "prefill worker, before it fails with UNAVAILABLE")
    http_port: int | None = Field(None, ge=0, le=65535,
                                  description="port of the OpenAI-compatible HTTP API (/v1/models, /v1/completions, "
                                              "/v1/chat/completions) on the router's host; 0 picks a free one, null "
                                              "serves none; `pdcluster serve` replaces it with --http-port (default "
                                              "8000, -1: off)")
    api_keys: list[str] = Field(default_factory=list, repr=False,
                                description="API keys; when any is set, every gRPC RPC and HTTP route needs one "
                                            "(`authorization: Bearer KEY`); `pdcluster serve` adds --api-key and "
                                            "$PDCLUSTER_API_KEYS (comma-separated)")
    open_health: bool = Field(False, description="with api_keys: answer grpc.health.v1 without a key (for probes "
                                                 "that cannot send one)")
    open_metrics: bool = Field(False, description="with api_keys: serve /metrics without a key")
    tls_cert: str | None = Field(None, description="PEM certificate of the router: gRPC, the HTTP API and /metrics "
                                                   "are served over TLS; needs tls_key")
    tls_key: str | None = Field(None, description="PEM private key of tls_cert")
    tls_client_ca: str | None = Field(None, description="PEM CA bundle: clients must present a certificate it "
                                                        "signed (mutual TLS); needs tls_cert")
    migration_limit: int = Field(2, ge=0, le=16, description="decode workers a request may lose and still go on: its "
                                                             "stream continues on another decode worker with no lost "
                                                             "or repeated token; one more loss ends it with "
                                                             "UNAVAILABLE; 0: no migration")
    migration_wait_s: float = Field(60.0, gt=0, description="how long a migrating stream waits for a decode worker to "
                                                            "continue on (the replacement of the lost one, when it "
                                                            "was the only one); the client's deadline may end it "
                                                            "sooner")
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved for each router actor")
    replicas: int = Field(1, ge=1, le=16,
                          description="routers serving the same workers, each its own actor and ports (router i "
                                      "listens on port + i, http_port + i and metrics_port + i; a port of 0 picks "
                                      "a free one); losing one leaves the others serving, and Ray restarts it")
    max_restarts: int = Field(10, ge=0, le=1000,
                              description="how often Ray restarts a lost router actor (a killed process); the new "
                                          "router finds the live workers, cancels what its predecessor had running "
                                          "on them and serves on the same ports; `pdcluster serve` exits non-zero "
                                          "when a router cannot come back")
    worker_timeout_s: float = Field(10.0, gt=0, le=3600,
                                    description="a worker that answers nothing (no engine step, no load report) for "
                                                "this long is marked unresponsive: no new placement, its streams "
                                                "migrate, its prefills move to another worker; if it wakes, its late "
                                                "outputs are ignored and it is taken back after a clean warm-up; "
                                                "a router that answers nothing to the cluster's supervisor "
                                                "for this long is killed, and Ray restarts it")
    fetch_min_pages: int = Field(1, ge=0, le=100000,
                                 description="prefix fetch: a prefill worker takes a prompt's cached leading pages "
                                             "from a node's KV store or another worker that holds at least this "
                                             "many more of them (by the router's KV index) when moving them is "
                                             "estimated faster than computing them; a fetch that fails is computed "
                                             "instead; 0: never fetch")
    request_log: str | None = Field(None, description="one JSON line per finished or failed request (ids, workers, "
                                                      "tokens, timings, error): a file path on the router's host, "
                                                      "- for the router's standard error, null: off")
    http_max_body_bytes: int | None = Field(None, ge=1024, description="largest HTTP request body, refused with 413 "
                                                                       "from its Content-Length before it is read (a "
                                                                       "chunked body: as soon as it passes); null: "
                                                                       "3 x the largest gRPC request that can fit "
                                                                       "max_model_len (room for JSON escapes) + "
                                                                       "64 KiB")
    http_header_timeout_s: float = Field(10.0, gt=0, le=3600,
                                         description="seconds a client has to send a request's headers, from the "
                                                     "connection (or its previous response) on; then the connection "
                                                     "is closed")
    http_body_timeout_s: float = Field(30.0, gt=0, le=3600, description="seconds a client has to send a whole "
                                                                        "request body; then 408 and the connection "
                                                                        "closes")
    http_keep_alive_s: float = Field(5.0, gt=0, le=3600, description="seconds an idle keep-alive connection is "
                                                                     "held between requests")
    http_max_connections: int = Field(1024, ge=1, le=100000,
                                      description="most HTTP connections open at once (API and /metrics each); a "
                                                  "connection past it gets 503 and is closed")
    metrics_port: int | None = Field(None, ge=0, le=65535,
                                     description="Prometheus /metrics port on the router host; 0 picks a free one, "
                                                 "null serves no metrics; `pdcluster serve` replaces it with "
                                                 "--metrics-port (default 9464, -1: off)")

    @model_validator(mode="after")
    def _locks_are_whole(self) -> RouterSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("router.tls_cert and router.tls_key go together: set both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("router.tls_client_ca (mutual TLS) needs router.tls_cert and router.tls_key")
        from router.security import check_key

        for i, k in enumerate(self.api_keys):
            try:
                check_key(k)
            except ValueError as exc:
                raise ValueError(f"router.api_keys[{i}]: {exc}") from None
        return self


class ClusterConfig(_Strict):
    model: str = Field("small", description="model to serve: a checkpoint folder, or a built-in name PRESET or "
                                            "ARCH-PRESET (e.g. tiny, small, qwen3-small)")
    transport: TransportSettings = Field(default_factory=TransportSettings,
                                         description="how prefill workers send KV to decode workers")
    router: RouterSettings = Field(default_factory=RouterSettings,
                                   description="the router: gRPC endpoint, placement policy, admission limits")
    pools: list[PoolConfig] = Field(..., description="worker pools; at least one decode or colocated pool, a "
                                                     "prefill pool needs a decode pool and the reverse, names "
                                                     "unique")
    autoscale: AutoscaleSettings = Field(default_factory=AutoscaleSettings,
                                         description="the SLA planner: resizes pools to hold a TTFT and ITL "
                                                     "objective (off by default)")
    kv_store: KVStoreSettings = Field(default_factory=KVStoreSettings,
                                      description="the KV store below the workers' caches: one per node, holding "
                                                  "the pages of finished requests for any worker to fetch")

    @model_validator(mode="after")
    def _pools_make_a_cluster(self) -> ClusterConfig:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        roles = {p.role for p in self.pools}
        if not roles & {"decode", "colocated"}:
            raise ValueError("pools need at least one decode or colocated pool")
        if "prefill" in roles and "decode" not in roles:
            raise ValueError("a prefill pool needs a decode pool to send its KV to")
        if "decode" in roles and "prefill" not in roles:
            raise ValueError("a decode pool needs a prefill pool (or make it role: colocated)")
        assert POLICIES  # the Literal above mirrors router.policy.POLICIES
        a = self.autoscale
        for name, ap in a.pools.items():
            if name not in names:
                raise ValueError(f"autoscale.pools: {name!r} is not a pool; pools are {names}")
            if ap.min_replicas > ap.max_replicas:
                raise ValueError(f"autoscale.pools.{name}.min_replicas must be in [1, max_replicas "
                                 f"{ap.max_replicas}], got {ap.min_replicas}")
        if a.budget_cpus is not None:
            floor = sum(p.resources.num_cpus * p.engine.tensor_parallel_size
                        * ((a.pools[p.name].min_replicas if p.name in a.pools else p.replicas) + p.spare_replicas)
                        for p in self.pools)
            if a.budget_cpus < floor:
                raise ValueError(f"autoscale.budget_cpus must be >= {floor:g} (every pool at its min_replicas, "
                                 f"plus spares), got {a.budget_cpus:g}")
        return self

    @property
    def hash_page_size(self) -> int:
        """Block hashes follow the prefill pool's pages: that is where prefix affinity pays."""
        for role in ("prefill", "colocated", "decode"):
            for p in self.pools:
                if p.role == role:
                    return p.engine.page_size
        raise AssertionError("validated: at least one pool")

    @property
    def max_model_len(self) -> int | None:
        lens = [p.engine.max_model_len for p in self.pools if p.engine.max_model_len]
        return min(lens) if lens else None

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))

    @classmethod
    def embedded(cls, *, model: str = "small", prefill: int = 1, decode: int = 1, transport: str = "nixl",
                 mode: str = "disaggregated", host: str = "127.0.0.1", port: int = 50051,
                 policy: str = "prefix-aware", engine: dict | None = None,
                 num_cpus: float | str | None = None) -> ClusterConfig:
        """The default: one prefill and one decode worker on CPU (or one colocated pool).
        `num_cpus` per rank: a number, "machine" (this machine's CPUs split over the ranks it
        starts, at least 1 each: what `pdcluster serve` and the demo start), or None (1)."""
        eng = engine or {}
        if mode == "colocated":
            pools = [dict(name="colocated", role="colocated", replicas=max(decode, 1), engine=eng)]
        elif mode == "disaggregated":
            pools = [dict(name="prefill", role="prefill", replicas=prefill, engine=eng),
                     dict(name="decode", role="decode", replicas=decode, engine=eng)]
        else:
            raise ValueError(f"mode must be 'disaggregated' or 'colocated', got {mode!r}")
        if num_cpus == "machine":
            ranks = sum(p["replicas"] * eng.get("tensor_parallel_size", 1) for p in pools)
            num_cpus = machine_share(ranks)
        if num_cpus is not None:
            for p in pools:
                p["resources"] = dict(num_cpus=num_cpus)
        return cls.model_validate(dict(model=model, transport=dict(kind=transport),
                                       router=dict(host=host, port=port, policy=policy), pools=pools))


def machine_share(ranks: int) -> int:
    """This machine's CPUs split over `ranks` engine processes: whole CPUs, at least 1 each."""
    import os

    return max(1, (os.cpu_count() or 1) // max(ranks, 1))


def check_model_fit(cfg: ClusterConfig) -> None:
    """What needs the model's own config: each pool's tensor_parallel_size must divide its
    attention heads. Raises ValueError naming `pools[i].engine.tensor_parallel_size`. Resolves
    the model (a built-in one is written to the cache, as Cluster.start does anyway)."""
    if all(p.engine.tensor_parallel_size == 1 for p in cfg.pools):
        return
    from engine.config import ModelConfig
    from engine.core import resolve_model
    from engine.parallel import check_tensor_parallel

    model = ModelConfig.from_pretrained(resolve_model(cfg.model))
    for i, p in enumerate(cfg.pools):
        try:
            check_tensor_parallel(model, p.engine.tensor_parallel_size)
        except ValueError as exc:
            raise ValueError(f"pools[{i}].engine.tensor_parallel_size (pool {p.name!r}, model {cfg.model!r}): "
                             f"{exc}") from None
