"""`LatencyModel`: the step-time model every planning tool speaks.

Filled either by fitting points the profiler measured on this machine
(`cluster.planning.fit`) or from a roofline of a model on a GPU (`cluster.planning.roofline`);
the simulator and the planner only call the methods below.

    prefill_time(t, c)  = p0 + p1*t + p2*t**2 + p3*t*c        (t new tokens in the batch, c cached/context tokens)
    decode_time(b, ctx) = d0 + d1*b + d2*ctx                  (b sequences, ctx = their summed context)
    transfer_time(n)    = x0 + n / x_bw                       (n KV bytes over the configured transport)
"""
from __future__ import annotations

import json
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
    source: str = ""                     # "profile:<file>" or "roofline:<gpu>" etc.
    meta: dict = field(default_factory=dict)

    def prefill_time(self, batch_tokens: int, cached_tokens: int = 0) -> float:
        p0, p1, p2, p3 = self.prefill
        t = float(batch_tokens)
        return max(p0 + p1 * t + p2 * t * t + p3 * t * float(cached_tokens), 0.0)

    def decode_time(self, batch_size: int, total_context: int) -> float:
        d0, d1, d2 = self.decode
        return max(d0 + d1 * batch_size + d2 * float(total_context), 0.0)

    def mixed_step_time(self, prefill_tokens: int, cached_tokens: int, batch_size: int, total_context: int) -> float:
        """One colocated step running a prefill chunk and a decode batch together: both
        parts' work, one fixed overhead."""
        if prefill_tokens <= 0:
            return self.decode_time(batch_size, total_context)
        if batch_size <= 0:
            return self.prefill_time(prefill_tokens, cached_tokens)
        return self.prefill_time(prefill_tokens, cached_tokens) + self.decode_time(batch_size, total_context) \
            - min(self.prefill[0], self.decode[0])

    def transfer_time(self, nbytes: int) -> float:
        return self.transfer_overhead_s + nbytes / self.transfer_bytes_per_s

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> LatencyModel:
        d = dict(d)
        d["prefill"], d["decode"] = tuple(d["prefill"]), tuple(d["decode"])
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> LatencyModel:
        d = json.loads(Path(path).read_text())
        return cls.from_json(d.get("latency_model", d))
