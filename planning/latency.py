"""`LatencyModel`: the step-time model every planning tool speaks.

Filled either by fitting points the profiler measured on this machine
(`planning.fit`) or from a roofline of a model on a GPU (`planning.roofline`);
the simulator and the planner only call the methods below.

    prefill_time(t, c)  = p0 + p1*t + p2*t**2 + p3*t*c        (t new tokens of one sequence after c in its KV)
    decode_time(b, ctx) = d0 + d1*b + d2*ctx                  (b sequences, ctx = their summed context)
    transfer_time(n)    = x0 + n / x_bw                       (n KV bytes over the configured transport)

A step that batches several prefill chunks and decodes (`step_time`) pays one fixed cost
(the larger of p0, d0) and each part's variable cost; the quadratic and context terms of a
prefill are per sequence (attention is), the linear ones per token.

`prefill_table`, where a calibration measured one (`serving_profile.calibrate`), holds a
sequence's prefill time at many lengths: the quadratic is then multiplied by the measured /
quadratic ratio, interpolated linearly between the table's lengths (held flat past its ends),
so that the model passes through every measured length. A real kernel's time is not a smooth
function of the length: on a Sapphire Rapids core, in-process, 1,280 tokens took 190-200 ms,
1,664 took 262-285 and 1,792 only 267 (per token 156, 171 and 150 us), where the quadratic
through 512, 1,024 and 1,984 tokens put the workload's 1,274- and 1,292-token prompts 9 % over
their measured TTFT (docs/capacity-planning.md).
"""
from __future__ import annotations

import bisect
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
    prefill_table: tuple = ()            # ((tokens, seconds), ...) of one fresh sequence, ascending
    source: str = ""                     # "profile:<file>" or "roofline:<gpu>" etc.
    meta: dict = field(default_factory=dict)
    _ratios: tuple = field(default=(), init=False, repr=False, compare=False)  # from prefill_table

    def __post_init__(self) -> None:
        table = tuple((int(t), float(s)) for t, s in self.prefill_table)
        if any(t < 1 or s <= 0 for t, s in table) or any(a[0] >= b[0] for a, b in zip(table, table[1:])):
            raise ValueError(f"prefill_table must be (tokens >= 1, seconds > 0) pairs with strictly ascending "
                             f"tokens, got {self.prefill_table!r}")
        self.prefill_table = table
        # measured / quadratic at each length of the table (the quadratic must be positive there)
        self._ratios = tuple((t, s / q) for t, s in table if (q := self._quadratic(t)) > 0)

    def _quadratic(self, t: float) -> float:
        p0, p1, p2, _ = self.prefill
        return p0 + p1 * t + p2 * t * t

    def _ratio(self, t: float) -> float:
        """The table's measured / quadratic ratio at `t` tokens (1 without a table)."""
        r = self._ratios
        if not r:
            return 1.0
        if t <= r[0][0]:
            return r[0][1]
        if t >= r[-1][0]:
            return r[-1][1]
        i = bisect.bisect_right(r, (t, float("inf")))
        (t0, r0), (t1, r1) = r[i - 1], r[i]
        return r0 + (r1 - r0) * (t - t0) / (t1 - t0)

    def prefill_time(self, batch_tokens: int, cached_tokens: int = 0) -> float:
        t = float(batch_tokens)
        return max(self._quadratic(t) * self._ratio(t) + self.prefill[3] * t * float(cached_tokens), 0.0)

    def decode_time(self, batch_size: int, total_context: int) -> float:
        d0, d1, d2 = self.decode
        return max(d0 + d1 * batch_size + d2 * float(total_context), 0.0)

    def step_time(self, chunks: Sequence[tuple[int, int]], num_decodes: int = 0, decode_context: int = 0) -> float:
        """One engine step running prefill `chunks` ((new tokens, tokens already in the KV) per
        sequence) and a decode batch of `num_decodes` sequences holding `decode_context` tokens."""
        p0, _, _, p3 = self.prefill
        d0, d1, d2 = self.decode
        fixed, var = 0.0, 0.0
        if chunks:
            fixed = p0
            for t, c in chunks:  # each sequence's own time, less the fixed cost the step pays once
                var += self._quadratic(t) * self._ratio(t) - p0 + p3 * t * c
        if num_decodes:
            fixed = max(fixed, d0)
            var += d1 * num_decodes + d2 * decode_context
        return max(fixed + var, 0.0)

    def decode_step_times(self, num_decodes: int, first_context: int, steps: int) -> list[float]:
        """`step_time((), num_decodes, first_context + k * num_decodes)` for k in range(steps), the
        same floats in one pass (a run of decode steps: the batch grows one token a sequence a step)."""
        d0, d1, d2 = self.decode
        if num_decodes <= 0:
            return [0.0] * steps
        fixed = max(0.0, d0)
        d1b = d1 * num_decodes
        return [max(fixed + (0.0 + (d1b + d2 * c)), 0.0)
                for c in range(first_context, first_context + steps * num_decodes, num_decodes)]

    def transfer_time(self, nbytes: int, transport: str | None = None) -> float:
        x0, bw = self.transfers.get(transport, (self.transfer_overhead_s, self.transfer_bytes_per_s)) \
            if transport else (self.transfer_overhead_s, self.transfer_bytes_per_s)
        return x0 + nbytes / bw

    def to_json(self) -> dict:
        d = asdict(self)
        del d["_ratios"]
        d["prefill_table"] = [list(p) for p in self.prefill_table]
        return d

    @classmethod
    def from_json(cls, d: dict) -> LatencyModel:
        d = dict(d)
        d["prefill"], d["decode"] = tuple(d["prefill"]), tuple(d["decode"])
        d["transfers"] = {k: tuple(v) for k, v in d.get("transfers", {}).items()}
        d["prefill_table"] = tuple(tuple(p) for p in d.get("prefill_table", ()))
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> LatencyModel:
        d = json.loads(Path(path).read_text())
        return cls.from_json(d.get("latency_model", d))
