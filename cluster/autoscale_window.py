"""What the SLA planner (cluster/autoscale.py) observes on router 0 over its windows: `Window`
differences snapshots of the router's request histograms and counters (router.metrics) over the
fast and the slow window; `RequestSamples` keeps each finished request's prompt, output and
cached tokens from the router's request log lines, for the slow window's length spread and
prefix-hit rate (the counters give only means)."""
from __future__ import annotations

import json
import logging
import math
import time
from collections import deque

REQUEST_LOGGER = "pdcluster.requests"  # router.metrics.log_request: one JSON line per request


def _samples(metric) -> list:
    return [s for fam in metric.collect() for s in fam.samples]


def _hist(metric) -> tuple[list[float], list[float], float, float]:
    """(upper bounds, cumulative counts, count, sum) of a prometheus_client Histogram."""
    bounds, counts, total, sum_ = [], [], 0.0, 0.0
    for s in _samples(metric):
        if s.name.endswith("_bucket"):
            bounds.append(float(s.labels["le"]))
            counts.append(s.value)
        elif s.name.endswith("_count"):
            total = s.value
        elif s.name.endswith("_sum"):
            sum_ = s.value
    return bounds, counts, total, sum_


def _counter(metric) -> float:
    return sum(s.value for s in _samples(metric) if s.name.endswith("_total"))


def percentile(bounds: list[float], counts: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of a histogram's cumulative bucket counts, linearly
    interpolated inside its bucket; a value past the last finite bound is that bound."""
    if not counts or counts[-1] <= 0:
        return None
    want = q / 100.0 * counts[-1]
    prev_b, prev_c = 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= want:
            if math.isinf(b):
                return prev_b
            return prev_b + (b - prev_b) * ((want - prev_c) / (c - prev_c) if c > prev_c else 1.0)
        prev_b, prev_c = b, c
    return prev_b


class Window:
    """Snapshots of a router's request metrics (router.metrics.RouterMetrics), differenced over
    the fast and the slow window."""

    def __init__(self, metrics, keep_s: float) -> None:
        self.m, self.keep_s = metrics, keep_s
        self.snaps: deque = deque()

    def snapshot(self, now: float) -> None:
        m = self.m
        self.snaps.append((now, {"ttft": _hist(m.ttft), "itl": _hist(m.itl), "e2e": _hist(m.e2e),
                                 "prefill": _hist(m.prefill), "requests": _counter(m.requests),
                                 "prompt": _counter(m.prompt_tokens), "generated": _counter(m.generation_tokens)}))
        while len(self.snaps) > 2 and now - self.snaps[1][0] >= self.keep_s:
            self.snaps.popleft()

    def _pair(self, now: float, span: float):
        if not self.snaps:
            return None, None
        last = self.snaps[-1]
        first = next((x for x in self.snaps if now - x[0] <= span + 1e-6), last)
        if first is last and len(self.snaps) > 1 and now - self.snaps[-2][0] <= span + 1e-6:
            first = self.snaps[-2]
        return first, last

    def fast(self, now: float, span: float, q: float) -> dict:
        """TTFT and ITL percentile q over the last `span` seconds (None where no sample), and the
        requests that got their first token."""
        first, last = self._pair(now, span)
        if first is None or first is last:
            return {"ttft_s": None, "itl_s": None, "requests": 0}
        out = {}
        for key in ("ttft", "itl"):
            b, c1 = last[1][key][0], last[1][key][1]
            c0 = first[1][key][1]
            diff = [a - z for a, z in zip(c1, c0)]
            out[f"{key}_s"] = percentile(b, diff, q)
        out["requests"] = int(last[1]["ttft"][2] - first[1]["ttft"][2])
        return out

    def slow(self, now: float, span: float) -> dict:
        """Over the last `span` seconds: finished requests per second, mean prompt and output
        tokens, mean time in the system and mean prefill time."""
        first, last = self._pair(now, span)
        if first is None or first is last:
            return {"rate": 0.0, "seconds": 0.0}
        a, z = first[1], last[1]
        secs = last[0] - first[0]
        n = z["requests"] - a["requests"]
        e2e_n = z["e2e"][2] - a["e2e"][2]
        pre_n = z["prefill"][2] - a["prefill"][2]
        return {"seconds": round(secs, 1), "requests": int(n), "rate": round(n / secs, 4) if secs > 0 else 0.0,
                "prompt_tokens": round((z["prompt"] - a["prompt"]) / n, 2) if n else 0.0,
                "output_tokens": round((z["generated"] - a["generated"]) / n, 2) if n else 0.0,
                "e2e_s": round((z["e2e"][3] - a["e2e"][3]) / e2e_n, 4) if e2e_n else 0.0,
                "prefill_s": round((z["prefill"][3] - a["prefill"][3]) / pre_n, 4) if pre_n else 0.0}


class RequestSamples(logging.Handler):
    """(time, prompt, output, cached tokens) of the router's finished requests, the latest `keep`."""

    def __init__(self, clock=time.monotonic, keep: int = 8192) -> None:
        super().__init__(logging.INFO)
        self.clock = clock
        self.samples: deque = deque(maxlen=keep)
        self._restore: tuple[int, bool] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            d = json.loads(record.getMessage())
            if "error" not in d:
                self.samples.append((self.clock(), int(d["prompt_tokens"]), int(d["completion_tokens"]),
                                     int(d.get("cached_tokens", 0))))
        except (ValueError, KeyError, TypeError):
            pass

    def attach(self) -> None:
        """The request lines are made only when the logger is enabled for INFO: where they were not,
        enable it and stop them propagating, so that they still go nowhere else."""
        logger = logging.getLogger(REQUEST_LOGGER)
        if not logger.isEnabledFor(logging.INFO):
            self._restore = (logger.level, logger.propagate)
            logger.setLevel(logging.INFO)
            logger.propagate = False
        logger.addHandler(self)

    def detach(self) -> None:
        logger = logging.getLogger(REQUEST_LOGGER)
        logger.removeHandler(self)
        if self._restore is not None:
            logger.setLevel(self._restore[0])
            logger.propagate = self._restore[1]
            self._restore = None

    def spread(self, now: float, span: float) -> dict:
        """Over the last `span` seconds: samples, the coefficient of variation (standard deviation
        / mean) of prompt and output lengths, and the prefix-cache hit rate (cached / prompt tokens)."""
        rows = [s for s in self.samples if now - s[0] <= span + 1e-6]
        out = {"samples": len(rows), "prompt_cv": None, "output_cv": None, "prefix_hit": None}
        if rows:
            prompt = sum(r[1] for r in rows)
            out["prefix_hit"] = round(min(1.0, sum(r[3] for r in rows) / prompt), 4) if prompt else 0.0
        if len(rows) >= 2:
            out["prompt_cv"] = round(_cv([r[1] for r in rows]), 4)
            out["output_cv"] = round(_cv([r[2] for r in rows]), 4)
        return out


def _cv(xs: list[int]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) / m if m > 0 else 0.0
