"""`LatencyModel`: the step-time model every planning tool speaks.

Filled either by fitting points the profiler measured on this machine
(`cluster.planning.fit`) or from a roofline of a model on a GPU (`cluster.planning.roofline`);
the simulator and the planner only call the methods below.

    prefill_time(t, c)  = p0 + p1*t + p2*t**2 + p3*t*c        (t new tokens of one sequence after c in its KV)
    decode_time(b, ctx) = d0 + d1*b + d2*ctx                  (b sequences, ctx = their summed context)
    transfer_time(n)    = x0 + n / x_bw                       (n KV bytes over the configured transport)

A step that batches several prefill chunks and decodes (`step_time`) pays one fixed cost
(the larger of p0, d0) and each part's variable cost; the quadratic and context terms of a
prefill are per sequence (attention is), the linear ones per token.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(slots=True)
class LatencyModel:
    prefill: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)   # p0, p1, p2, p3
    decode: tuple[float, float, float] = (0.0, 0.0, 0.0)                # d0, d1, d2
    transfer_overhead_s: float = 0.0                                    # x0
    transfer_bytes_per_s: float = float("inf")                          # x_bw
    kv_bytes_per_token: int = 0          # all layers, K and V
    max_batched_tokens: int = 2048       # the engine's prefill token budget per step
    num_layers: int = 1                  # KV is sent layer by layer: the last layer's share is what shows
    transfers: dict = field(default_factory=dict)  # transport kind -> [x0, x_bw], when profiled per transport
    source: str = ""                     # "profile:<file>" or "roofline:<gpu>" etc.
    meta: dict = field(default_factory=dict)

    def prefill_time(self, batch_tokens: int, cached_tokens: int = 0) -> float:
        p0, p1, p2, p3 = self.prefill
        t = float(batch_tokens)
        return max(p0 + p1 * t + p2 * t * t + p3 * t * float(cached_tokens), 0.0)

    def decode_time(self, batch_size: int, total_context: int) -> float:
        d0, d1, d2 = self.decode
        return max(d0 + d1 * batch_size + d2 * float(total_context), 0.0)

    def step_time(self, chunks: Sequence[tuple[int, int]], num_decodes: int = 0, decode_context: int = 0) -> float:
        """One engine step running prefill `chunks` ((new tokens, tokens already in the KV) per
        sequence) and a decode batch of `num_decodes` sequences holding `decode_context` tokens."""
        p0, p1, p2, p3 = self.prefill
        d0, d1, d2 = self.decode
        fixed, var = 0.0, 0.0
        if chunks:
            fixed = p0
            for t, c in chunks:
                var += t * (p1 + p2 * t + p3 * c)
        if num_decodes:
            fixed = max(fixed, d0)
            var += d1 * num_decodes + d2 * decode_context
        return max(fixed + var, 0.0)

    def transfer_time(self, nbytes: int, transport: str | None = None) -> float:
        x0, bw = self.transfers.get(transport, (self.transfer_overhead_s, self.transfer_bytes_per_s)) \
            if transport else (self.transfer_overhead_s, self.transfer_bytes_per_s)
        return x0 + nbytes / bw

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> LatencyModel:
        d = dict(d)
        d["prefill"], d["decode"] = tuple(d["prefill"]), tuple(d["decode"])
        d["transfers"] = {k: tuple(v) for k, v in d.get("transfers", {}).items()}
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> LatencyModel:
        d = json.loads(Path(path).read_text())
        return cls.from_json(d.get("latency_model", d))
