"""Least-squares fits of the `LatencyModel` formulas to measured or roofline points.

Each fit solves with `numpy.linalg.lstsq`, weighting every point by 1/y so that the relative
error is what is minimised: step times span two orders of magnitude, and an unweighted fit
lets the few longest steps set the coefficients (one CPU decode profile: median error 45 %
unweighted, 10 % weighted). With `nonneg=True` any negative coefficient is clamped to zero and
the rest refit (a step cannot get faster with more work). Every fit reports its R^2 and the
largest relative error over the points, so a bad fit is visible.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(slots=True)
class FitResult:
    coef: tuple[float, ...]
    r2: float
    max_rel_err: float
    n: int

    def as_dict(self) -> dict:
        return asdict(self)


def _lstsq(x: np.ndarray, y: np.ndarray, nonneg: bool) -> FitResult:
    if len(y) < x.shape[1]:
        raise ValueError(f"need at least {x.shape[1]} points to fit, got {len(y)}")
    active = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    w = 1.0 / np.maximum(np.abs(y), 1e-12)
    for _ in range(x.shape[1]):
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        coef[:] = 0.0
        coef[active] = sol
        if not nonneg or (coef >= 0).all():
            break
        active &= coef > 0
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    rel = np.abs(pred - y) / np.maximum(np.abs(y), 1e-12)
    return FitResult(tuple(float(c) for c in coef), r2, float(rel.max()), len(y))


def fit_prefill(points: list[tuple[int, int, float]], nonneg: bool = True) -> FitResult:
    """points: (new tokens t, cached tokens c, seconds) -> p0 + p1*t + p2*t^2 + p3*t*c."""
    a = np.asarray(points, dtype=float)
    t, c, y = a[:, 0], a[:, 1], a[:, 2]
    return _lstsq(np.stack([np.ones_like(t), t, t * t, t * c], 1), y, nonneg)


def fit_decode(points: list[tuple[int, int, float]], nonneg: bool = True) -> FitResult:
    """points: (batch size b, summed context, seconds) -> d0 + d1*b + d2*ctx."""
    a = np.asarray(points, dtype=float)
    b, ctx, y = a[:, 0], a[:, 1], a[:, 2]
    return _lstsq(np.stack([np.ones_like(b), b, ctx], 1), y, nonneg)


def fit_transfer(points: list[tuple[int, float]], nonneg: bool = True) -> FitResult:
    """points: (bytes, seconds) -> x0 + n/bw; coef is (x0, bw) with bw in bytes/s (inf if flat)."""
    a = np.asarray(points, dtype=float)
    n, y = a[:, 0], a[:, 1]
    res = _lstsq(np.stack([np.ones_like(n), n], 1), y, nonneg)
    x0, slope = res.coef
    res.coef = (x0, 1.0 / slope if slope > 0 else float("inf"))
    return res
