"""Small timing helpers shared by benchmarks: a wall-clock timer and sample summaries.
Pure Python; must not import torch or the engine."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of one call, by the monotonic high-resolution clock."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


@dataclass(slots=True, frozen=True)
class Summary:
    """Seconds: the median is the figure we report; the spread says how noisy the run was."""

    n: int
    median: float
    p10: float
    p90: float
    minimum: float

    @classmethod
    def of(cls, samples: list[float]) -> Summary:
        if not samples:
            raise ValueError("cannot summarize an empty list of samples")
        ordered = sorted(samples)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return cls(len(ordered), statistics.median(ordered), pct(0.1), pct(0.9), ordered[0])

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
