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
from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.policy import POLICIES


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResourceShape(_Strict):
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs per replica")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica")
    accelerator_type: str | None = Field(None, description="Ray accelerator type, e.g. H100 or A10G")
    custom: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per replica")

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.num_cpus, **self.custom}
        if self.num_gpus:
            b["GPU"] = self.num_gpus
        if self.accelerator_type:
            b[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return {k: v for k, v in b.items() if v}


class EngineSettings(_Strict):
    tensor_parallel_size: int = Field(1, ge=1, le=1, description="TP degree (only 1 is served yet)")
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page")
    num_pages: int | None = Field(None, ge=1, description="KV page budget (default: from memory)")
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    dtype: str | None = Field(None, description="float32 (CPU default), bfloat16, float16")
    attention_backend: Literal["auto", "cpu", "torch", "flashinfer"] = Field(
        "auto", description="auto: flashinfer on CUDA where installed, the compiled CPU kernel on CPUs, else torch")
    local_prefill_threshold: int = Field(0, ge=0, description="decode: prefill here below this many uncached tokens")
    reserve_pages: int = Field(0, ge=0, description="decode: pages kept free for the running batch")
    on_transfer_failure: Literal["fail", "reprefill"] = "fail"

    def engine_kwargs(self) -> dict:
        kw = dict(page_size=self.page_size, max_num_batched_tokens=self.max_num_batched_tokens,
                  max_num_seqs=self.max_num_seqs, attention_backend=self.attention_backend)
        for name in ("num_pages", "max_model_len", "dtype"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return kw


class PoolConfig(_Strict):
    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    role: Literal["prefill", "decode", "colocated"]
    replicas: int = Field(1, ge=1, le=256)
    resources: ResourceShape = Field(default_factory=ResourceShape)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"


class TransportSettings(_Strict):
    kind: Literal["nixl", "grpc"] = "nixl"
    deadline_s: float = Field(30.0, gt=0, description="whole KV transfer of one request, from the prefill's start")
    begin_timeout_s: float = Field(300.0, gt=0, description="how long a decode worker's reserved pages wait for "
                                                            "the prefill to start sending (queueing in the prefill pool)")


class RouterSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535, description="0 picks a free port")
    policy: Literal["round-robin", "least-loaded", "prefix-aware"] = "prefix-aware"
    max_inflight: int = Field(64, ge=1)
    max_queue: int = Field(256, ge=0)
    max_prefill_attempts: int = Field(2, ge=1, le=8)
    num_cpus: float = Field(1.0, ge=0)
    metrics_port: int | None = Field(None, ge=0, le=65535,
                                     description="Prometheus /metrics port on the router host; 0 picks a free one, "
                                                 "None (default) serves no metrics")


class ClusterConfig(_Strict):
    model: str = Field("small", description="checkpoint folder or built-in name (tiny, small, qwen3-small, ...)")
    transport: TransportSettings = Field(default_factory=TransportSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    pools: list[PoolConfig]

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
                 policy: str = "prefix-aware", engine: dict | None = None) -> ClusterConfig:
        """The default: one prefill and one decode worker on CPU (or one colocated pool)."""
        eng = engine or {}
        if mode == "colocated":
            pools = [dict(name="colocated", role="colocated", replicas=max(decode, 1), engine=eng)]
        elif mode == "disaggregated":
            pools = [dict(name="prefill", role="prefill", replicas=prefill, engine=eng),
                     dict(name="decode", role="decode", replicas=decode, engine=eng)]
        else:
            raise ValueError(f"mode must be 'disaggregated' or 'colocated', got {mode!r}")
        return cls.model_validate(dict(model=model, transport=dict(kind=transport),
                                       router=dict(host=host, port=port, policy=policy), pools=pools))
