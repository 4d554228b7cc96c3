"""The pure parts of `pdcluster bench autoscale` (bench/autoscale_bench.py): worker-seconds from a
polled status timeline, SLO attainment per request, step response, the step load, time bins."""
from __future__ import annotations

import pytest

from bench.autoscale_bench import (bin_timeline, first_time_at, first_time_below, integrate_steps, ratios,
                                   request_meets, slo_attainment, step_arrivals)
from loadgen.metrics import RequestRecord


def test_worker_seconds_hold_each_value_until_the_next_poll_and_clip_to_the_span():
    # 1 worker until t=10, 2 from 10 to 25, 1 after: over [0, 40] -> 10 + 30 + 15
    samples = [(0.5, 1), (10.0, 2), (25.0, 1)]
    assert integrate_steps(samples, 0.0, 40.0) == pytest.approx(10.0 + 30.0 + 15.0)
    # before the first poll the first value holds; the span clips both ends
    assert integrate_steps(samples, 5.0, 20.0) == pytest.approx(5.0 + 20.0)
    assert integrate_steps([(3.0, 2)], 0.0, 4.0) == pytest.approx(8.0)
    assert integrate_steps([], 0.0, 10.0) == 0.0
    assert integrate_steps(samples, 10.0, 10.0) == 0.0


def test_a_constant_pool_costs_replicas_times_the_span():
    samples = [(i * 0.25, 2) for i in range(200)]
    assert integrate_steps(samples, 0.0, 60.0) == pytest.approx(120.0)


def rec(ok=True, ttft=0.1, chunks=(0.1, 0.15, 0.2, 0.25)):
    return RequestRecord(index=0, request_id="r", scheduled_s=0.0, start_s=0.0, prompt_len=8, max_tokens=4, ok=ok,
                         ttft_s=ttft if ok else None, chunk_times_s=list(chunks) if ok else [])


def test_slo_attainment_reads_ttft_and_the_p90_gap_and_counts_failures_as_misses():
    good = rec()                                          # gaps 50 ms
    slow_first = rec(ttft=2.0, chunks=(2.0, 2.05))
    one_stall = rec(chunks=(0.1,) + tuple(0.1 + 0.05 * i for i in range(1, 20)) + (1.2,))  # 19 gaps of 50, one of 250
    all_slow = rec(chunks=(0.1, 0.4, 0.7, 1.0))           # gaps 300 ms
    failed = rec(ok=False)
    one_token = rec(chunks=(0.1,))
    assert request_meets(good.ok, good.ttft_s, good.chunk_times_s, 1.0, 0.06)
    assert not request_meets(slow_first.ok, slow_first.ttft_s, slow_first.chunk_times_s, 1.0, 0.06)
    assert request_meets(one_stall.ok, one_stall.ttft_s, one_stall.chunk_times_s, 1.0, 0.1)  # p90 forgives one
    assert not request_meets(one_stall.ok, one_stall.ttft_s, one_stall.chunk_times_s, 1.0, 0.1, strict=True)
    assert request_meets(one_token.ok, one_token.ttft_s, one_token.chunk_times_s, 1.0, 0.001)
    records = [good, slow_first, one_stall, all_slow, failed, one_token]
    assert slo_attainment(records, 1.0, 0.1) == pytest.approx(3 / 6)
    assert slo_attainment(records, 1.0, 0.1, strict=True) == pytest.approx(2 / 6)
    assert slo_attainment(records, 5.0, 1.0) == pytest.approx(5 / 6)
    assert slo_attainment([], 1.0, 1.0) == 0.0


def test_step_response_times_and_ratios():
    target = [(0.0, 1), (10.4, 1), (11.0, 2), (30.0, 2), (40.0, 1)]
    current = [(0.0, 1), (11.0, 1), (15.5, 2), (41.0, 1)]
    assert first_time_at(target, 10.0, 2) == 11.0
    assert first_time_at(current, 10.0, 2) == 15.5
    assert first_time_at(current, 50.0, 2) is None
    assert first_time_below(current, 15.5, 2) == 41.0
    r = ratios({"small": {"worker_seconds": 60.0, "slo_attainment": 0.5, "ttft_p90_ms": 100.0, "itl_p90_ms": 50.0},
                "large": {"worker_seconds": 120.0, "slo_attainment": 1.0, "ttft_p90_ms": 50.0, "itl_p90_ms": 25.0},
                "elastic": {"worker_seconds": 80.0, "slo_attainment": 0.9, "ttft_p90_ms": 60.0, "itl_p90_ms": 30.0}})
    assert r["elastic_vs_small"]["worker_seconds"] == pytest.approx(1.333, abs=1e-3)
    assert r["elastic_vs_large"]["worker_seconds"] == pytest.approx(0.667, abs=1e-3)
    assert r["elastic_vs_large"]["slo_attainment"] == pytest.approx(0.9)


def test_step_load_and_time_bins():
    times = step_arrivals([(10.0, 1.0), (10.0, 20.0), (10.0, 0.0)], seed=1)
    assert times == sorted(times) and all(0 <= t < 20.0 for t in times)
    burst = sum(10.0 <= t < 20.0 for t in times)
    assert 120 <= burst <= 280 and sum(t < 10.0 for t in times) < 30
    assert step_arrivals([(10.0, 1.0)], seed=1) == step_arrivals([(10.0, 1.0)], seed=1)
    r1 = RequestRecord(index=0, request_id="a", scheduled_s=0.5, start_s=0.5, prompt_len=4, max_tokens=3, ok=True,
                       ttft_s=0.2, chunk_times_s=[0.2, 0.3, 2.0])
    r2 = RequestRecord(index=1, request_id="b", scheduled_s=1.5, start_s=1.5, prompt_len=4, max_tokens=1)
    bins = bin_timeline([r1, r2], 1.0, 3.0)
    assert [b["arrival_rate"] for b in bins] == [1.0, 1.0, 0.0]
    assert bins[0]["ttft_p90_ms"] == 200.0 and bins[1]["ttft_p90_ms"] is None
    assert bins[0]["itl_p90_ms"] == 100.0 and bins[2]["itl_p90_ms"] == 1700.0  # the gap that ended at 2.5 s
