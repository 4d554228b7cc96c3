"""Per-request benchmark records and the summary figures computed from them.

Definitions (the same as vLLM's `bench serve`):
- TTFT: first chunk time - send time. E2E: last chunk time - send time.
- TPOT per request: (E2E - TTFT) / (output_tokens - 1), only for requests with > 1 token.
- ITL: every gap between consecutive chunks of a request, pooled over all requests.
- Throughputs count completed requests only, over the whole run's duration.
- Goodput: completed requests/s meeting ALL given SLOs (milliseconds). The ITL SLO holds
  when every chunk gap of the request is <= the SLO (the strictest reading).
Failed requests are counted and broken down by status code (and, under each code, by the
server's detail message), never dropped silently.
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

SLO_KEYS = ("ttft", "tpot", "itl", "e2e")
METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass(slots=True)
class RequestRecord:
    index: int
    request_id: str
    scheduled_s: float  # workload arrival offset
    start_s: float  # actual send offset (later than scheduled when waiting for concurrency)
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error: str = ""  # gRPC status code name (or NO_TOKENS) of a failed request
    error_detail: str = ""  # the server's message for it: the cause, not just the class
    ttft_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # relative to start_s
    output_tokens: int = 0
    e2e_s: float | None = None
    cached_tokens: int = 0
    server: dict = field(default_factory=dict)  # queue_s, prefill_s, transfer_s, workers...

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]


def parse_slo(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput item {item!r}: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput item {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput item {item!r}: milliseconds must be > 0")
        slo[key] = ms
    return slo


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an ascending list."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _stats_ms(values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float | None]:
    vals = sorted(v * 1000.0 for v in values_s)
    out: dict[str, float | None] = {"count": len(vals)}
    if not vals:
        out.update(mean=None, median=None, std=None, **{f"p{q:g}": None for q in percentiles})
        return out
    out.update(mean=statistics.fmean(vals), median=statistics.median(vals), std=statistics.pstdev(vals))
    out.update({f"p{q:g}": percentile(vals, q) for q in percentiles})
    return out


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    if not record.ok:
        return False
    checks = {"ttft": lambda: record.ttft_s is not None and record.ttft_s * 1e3 <= slo["ttft"],
              "e2e": lambda: record.e2e_s is not None and record.e2e_s * 1e3 <= slo["e2e"],
              # one-token answers have no decode phase: nothing to violate
              "tpot": lambda: record.tpot_s is None or record.tpot_s * 1e3 <= slo["tpot"],
              "itl": lambda: all(g * 1e3 <= slo["itl"] for g in record.itls_s)}
    return all(checks[k]() for k in slo)


def _error_details(failed: list[RequestRecord]) -> dict[str, dict[str, int]]:
    """{code: {detail: count}}: which causes stand behind each status code."""
    out: dict[str, dict[str, int]] = {}
    for r in failed:
        per_code = out.setdefault(r.error or "unknown", {})
        per_code[r.error_detail] = per_code.get(r.error_detail, 0) + 1
    return out


def summarize(records: list[RequestRecord], duration_s: float, percentiles: tuple[float, ...] = (50, 90, 99),
              slo: dict[str, float] | None = None) -> dict:
    """Every figure of the run as a plain JSON-able dict; latencies in ms, rates per second."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    for q in percentiles:
        if not 0 <= q <= 100:
            raise ValueError(f"percentile {q} outside 0..100")
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    summary: dict = {
        "duration_s": duration_s,
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(failed),
        "errors": dict(Counter(r.error or "unknown" for r in failed)),
        "error_details": _error_details(failed),
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + out_tokens) / duration_s,
        "percentiles": list(percentiles),
        "ttft_ms": _stats_ms([r.ttft_s for r in done if r.ttft_s is not None], percentiles),
        "tpot_ms": _stats_ms([t for r in done if (t := r.tpot_s) is not None], percentiles),
        "itl_ms": _stats_ms([g for r in done for g in r.itls_s], percentiles),
        "e2e_ms": _stats_ms([r.e2e_s for r in done if r.e2e_s is not None], percentiles),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in done)
        summary["slo_ms"] = dict(slo)
        summary["goodput"] = good / duration_s
        summary["good_requests"] = good
        summary["good_fraction"] = good / len(records) if records else 0.0
    return summary
