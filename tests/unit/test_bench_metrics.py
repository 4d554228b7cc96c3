"""loadgen.metrics on hand-built records with known times."""
import pytest

from loadgen.metrics import RequestRecord, parse_slo, summarize


def rec(i, ttft, chunks, ok=True, error="", prompt=10):
    return RequestRecord(index=i, request_id=str(i), scheduled_s=0.0, start_s=0.0, prompt_len=prompt,
                         max_tokens=len(chunks), ok=ok, error=error, ttft_s=ttft if ok else None,
                         chunk_times_s=chunks if ok else [], output_tokens=len(chunks) if ok else 0,
                         e2e_s=chunks[-1] if ok else None)


def test_latency_definitions_and_throughput():
    a = rec(0, 0.1, [0.1, 0.2, 0.3])          # tpot 100 ms, gaps 100,100
    b = rec(1, 0.3, [0.3, 0.35, 0.4, 0.7])    # tpot (0.7-0.3)/3, gaps 50,50,300
    bad = rec(2, 0, [0.0], ok=False, error="UNAVAILABLE")
    s = summarize([a, b, bad], duration_s=2.0, percentiles=(50, 99))
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == {"UNAVAILABLE": 1}
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((100 + 400 / 3) / 2)
    assert s["itl_ms"]["count"] == 5 and s["itl_ms"]["median"] == pytest.approx(100.0)
    assert s["itl_ms"]["p99"] == pytest.approx(100 + 0.96 * 200)  # interpolated between 100 and 300
    assert s["e2e_ms"]["p50"] == pytest.approx(500.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx((20 + 7) / 2)


def test_failures_keep_their_cause_under_their_code():
    ok = rec(0, 0.1, [0.1, 0.2])
    busy = [rec(i, 0, [0.0], ok=False, error="UNAVAILABLE") for i in (1, 2)]
    for r in busy:
        r.error_detail = "no healthy prefill worker"
    gone = rec(3, 0, [0.0], ok=False, error="UNAVAILABLE")
    gone.error_detail = "request ended on decode worker decode-0: error: transfer deadline"
    bad = rec(4, 0, [0.0], ok=False, error="INVALID_ARGUMENT")
    bad.error_detail = "sampling.max_tokens must be >= 1, got 0"
    s = summarize([ok, *busy, gone, bad], duration_s=1.0)
    assert s["failed"] == 4 and s["errors"] == {"UNAVAILABLE": 3, "INVALID_ARGUMENT": 1}
    assert s["error_details"] == {
        "UNAVAILABLE": {"no healthy prefill worker": 2,
                        "request ended on decode worker decode-0: error: transfer deadline": 1},
        "INVALID_ARGUMENT": {"sampling.max_tokens must be >= 1, got 0": 1}}


def test_goodput_needs_every_slo():
    fast = rec(0, 0.05, [0.05, 0.06, 0.07])   # ttft 50, tpot 10
    slow_decode = rec(1, 0.05, [0.05, 0.5])   # ttft ok, tpot 450
    s = summarize([fast, slow_decode], 1.0, slo=parse_slo(["ttft:100", "tpot:50"]))
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(1.0) and s["good_fraction"] == 0.5
    s = summarize([fast, slow_decode], 1.0, slo={"itl": 200.0})
    assert s["good_requests"] == 1


def test_parse_slo_errors_name_the_item():
    with pytest.raises(ValueError, match="latency:5.*ttft, tpot, itl, e2e"):
        parse_slo(["latency:5"])
    with pytest.raises(ValueError, match="ttft:abc"):
        parse_slo(["ttft:abc"])
