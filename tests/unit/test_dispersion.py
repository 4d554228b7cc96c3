"""Predicted percentiles with the per-request spread a load run shows beyond the model."""
import math
import statistics
from types import SimpleNamespace

import pytest

from loadgen.metrics import summarize
from planning.dispersion import disperse_summary, expected_stats, pool, residuals


def _rec(i, ttft, gap, n=20, ok=True):
    return {"index": i, "ok": ok, "ttft_s": ttft, "output_tokens": n, "mean_later_gap_s": gap}


def test_residuals_are_centred_logs_of_measured_over_predicted():
    pred = [_rec(i, 0.100, 0.010) for i in range(5)]
    meas = [_rec(0, 0.110, 0.012), _rec(1, 0.100, 0.010), _rec(2, 0.090, 0.008), _rec(3, 0.300, 0.010, n=3),
            _rec(4, 0.100, 0.010, ok=False)]
    r = residuals(meas, pred)
    # a failed request counts nowhere; one of 3 outputs has a TTFT but no TPOT residual
    assert len(r["ttft"]) == 4 and len(r["tpot"]) == 3
    # TTFT centred on the median (the calibration's first-token delay is a median), TPOT on the mean
    assert statistics.median(r["ttft"]) == pytest.approx(0.0, abs=1e-12)
    assert r["ttft"][0] - r["ttft"][1] == pytest.approx(math.log(1.1))
    assert sum(r["tpot"]) == pytest.approx(0.0, abs=1e-12)
    assert max(r["tpot"]) - min(r["tpot"]) == pytest.approx(math.log(0.012 / 0.008))


def test_pooled_tpot_residuals_average_a_ratio_of_one():
    p = pool([{"ttft": [0.1], "tpot": [-0.3, 0.3]}, {"ttft": [-0.1, 0.0], "tpot": [0.0]}])
    assert len(p["ttft"]) == 3 and len(p["tpot"]) == 3
    assert sum(math.exp(x) for x in p["tpot"]) / 3 == pytest.approx(1.0)


def test_a_runs_p90_lies_above_the_p90_of_equal_predictions():
    # 80 requests all predicted at 10 ms, each landing 20 % either side at random: one run's p90 is
    # the upper side, its median about the middle, where the plain figures say 10 ms for both
    vals = [10.0] * 80
    plain = expected_stats(vals, [])
    assert plain["p90"] == plain["median"] == 10.0
    s = expected_stats(vals, [math.log(0.8), math.log(1.2)], draws=200)
    assert s["p90"] == pytest.approx(12.0, rel=1e-6)
    assert 8.0 < s["median"] < 12.0
    assert s["mean"] == pytest.approx(10.0, rel=0.02)


def test_disperse_summary_keeps_the_simulators_own_figures():
    recs = [SimpleNamespace(ok=True, ttft_s=0.05 + 0.001 * i, tpot_s=0.01, output_tokens=10, prompt_len=10,
                            itls_s=[0.01] * 9, e2e_s=0.2, cached_tokens=0, error=None) for i in range(40)]
    s = summarize(recs, 10.0)
    d = disperse_summary(s, recs, {"ttft": [-0.1, 0.1], "tpot": [0.0]})
    assert d["deterministic"]["ttft_ms"] == s["ttft_ms"] and d["ttft_ms"]["p90"] > s["ttft_ms"]["p90"]
    assert d["tpot_ms"]["p90"] == pytest.approx(s["tpot_ms"]["p90"])  # a zero residual changes nothing
    assert d["request_throughput"] == s["request_throughput"]
    assert d["dispersion"] == {"ttft": {"n": 2, "sd": pytest.approx(0.1)}, "tpot": {"n": 1, "sd": 0.0}}
