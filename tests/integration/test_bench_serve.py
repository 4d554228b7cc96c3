"""`bench serve` against a real in-process router with one prefill and one decode worker on
the built-in tiny llama (local KV transfer), over gRPC on loopback; the router's Prometheus
`/metrics` is scraped and parsed while the benchmark runs and must agree with it (KV transfer
bytes included). A refused request keeps the server's reason; the scaled Mooncake trace's
shared blocks are prefix-cache hits on the server."""
from __future__ import annotations

import json
import threading

import pytest

from loadgen.client import model_info, run_benchmark_sync
from loadgen.metrics import summarize
from loadgen.report import format_table, write_json
from loadgen.workloads import Workload, WorkloadRequest, build_workload, dataset_path, materialize_prompts
from cluster.cli import main as pdcluster_main
from tests.helpers import kv_bytes_moved, scrape, value


def test_random_workload_end_to_end(metrics_cluster, tmp_path):
    import asyncio
    server, _, decode = metrics_cluster
    address = server.address
    before = scrape(server.metrics_url)
    snaps: list[dict] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.wait(0.05):
            snaps.append(scrape(server.metrics_url))

    info = asyncio.run(model_info(address))
    wl = build_workload("random", num_requests=12, input_range=(8, 40), output_range=(4, 12), request_rate=20.0,
                        max_model_len=info.max_model_len, seed=1)
    materialize_prompts(wl, info.vocab_size, seed=1)
    t = threading.Thread(target=scraper)
    t.start()
    try:
        records, duration, timeline = run_benchmark_sync(address, wl, max_concurrency=6, progress=False)
    finally:
        stop.set()
        t.join()
    assert [r.error for r in records if not r.ok] == []
    # The server's view, scraped and parsed during and after the run, agrees with the client's.
    after = scrape(server.metrics_url)
    assert snaps and max(value(s, "pdcluster_router_running_requests") for s in snaps) >= 1
    for name in ("pdcluster_request_ttft_seconds_count", "pdcluster_request_e2e_seconds_count"):
        assert value(after, name) - value(before, name) == 12
    assert value(after, "pdcluster_requests_total", finish_reason="length") - \
        value(before, "pdcluster_requests_total", finish_reason="length") == 12
    assert value(after, "pdcluster_generation_tokens_total") - value(before, "pdcluster_generation_tokens_total") \
        == sum(r.output_tokens for r in records)
    delta = lambda name: value(after, name) - value(before, name)
    assert delta("pdcluster_kv_transfer_bytes_count") == 12
    assert delta("pdcluster_kv_transfer_bytes_sum") == kv_bytes_moved(decode, [r.prompt_len for r in records])
    itl_gaps = sum(len(r.chunk_times_s) - 1 for r in records)
    assert value(after, "pdcluster_request_itl_seconds_count") - value(before, "pdcluster_request_itl_seconds_count") \
        == itl_gaps
    for r, req in zip(records, wl.requests):
        assert r.ttft_s is not None and r.chunk_times_s and r.ttft_s <= r.e2e_s
        assert r.output_tokens == req.output_len  # ignore_eos: every requested token comes back
        assert r.start_s >= r.scheduled_s - 1e-3
        assert r.server["decode_worker"] == "decode-0"
    assert max(depth for _, depth, _ in timeline.samples) >= 1 and timeline.samples[-1][1] == 0
    s = summarize(records, duration, slo={"ttft": 60_000.0})
    assert s["completed"] == 12 and s["failed"] == 0 and s["good_requests"] == 12
    assert 0 < s["ttft_ms"]["mean"] <= s["e2e_ms"]["mean"] and s["itl_ms"]["count"] > 0
    assert s["output_throughput"] > 0
    table = format_table(s)
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table
    write_json(tmp_path / "out.json", s, records, {"test": True})
    assert len(json.loads((tmp_path / "out.json").read_text())["requests"]) == 12


def test_cli_writes_json(metrics_router, tmp_path, capsys):
    address = metrics_router.address
    out = tmp_path / "bench.json"
    rc = pdcluster_main(["bench", "serve", "--address", address, "--num-requests", "6", "--request-rate", "30",
                         "--random-input-len", "8:24", "--random-output-len", "3:6", "--no-progress",
                         "--goodput", "ttft:60000", "--json", str(out), "--plot", str(tmp_path / "plots")])
    assert rc == 0
    assert "Successful requests:" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["summary"]["completed"] == 6 and doc["summary"]["failed"] == 0
    assert doc["config"]["num_requests"] == 6 and len(doc["requests"]) == 6
    assert sorted(p.name for p in (tmp_path / "plots").glob("*.png")) == [
        "itl_cdf.png", "queue_depth.png", "throughput_over_time.png", "ttft_cdf.png"]


def test_failed_request_keeps_the_servers_reason(metrics_router, tmp_path):
    """A refused request is counted under its status code and keeps the server's message, in
    the record and in the JSON; the request next to it is served."""
    info_len = 256  # the fixture's max_model_len
    wl = Workload([WorkloadRequest(0, 0.0, info_len + 10, 4, prompt_token_ids=[5] * (info_len + 10)),
                   WorkloadRequest(1, 0.0, 12, 4, prompt_token_ids=list(range(3, 15)))], 0, "two")
    records, duration, _ = run_benchmark_sync(metrics_router.address, wl, progress=False)
    too_long, fine = records
    assert fine.ok and fine.output_tokens == 4
    assert not too_long.ok and too_long.error == "INVALID_ARGUMENT"
    assert f"{info_len + 10} tokens" in too_long.error_detail and "max_model_len=256" in too_long.error_detail
    s = summarize(records, duration)
    assert s["errors"] == {"INVALID_ARGUMENT": 1}
    assert s["error_details"] == {"INVALID_ARGUMENT": {too_long.error_detail: 1}}
    write_json(tmp_path / "out.json", s, records, {})
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["requests"][0]["error_detail"] == too_long.error_detail


@pytest.mark.skipif(not dataset_path("mooncake-conv").is_file(),
                    reason=f"shared trace absent at {dataset_path('mooncake-conv')}")
def test_mooncake_shared_prefix_hits_the_servers_prefix_cache(metrics_router, tmp_path):
    """Every request of the Mooncake conversation trace starts with block 0 (its system prompt)
    and shares nothing after it with the requests before it. Scaled by 1/16, a 512-token block
    is 32 tokens = 2 full 16-token pages, so once the first request is prefilled, each later one
    must find exactly those 32 tokens in the prefill worker's prefix cache (one at a time, so no
    two prefills of the shared block overlap). `cached_tokens` is the server's own count."""
    out = tmp_path / "mooncake.json"
    rc = pdcluster_main(["bench", "serve", "--address", metrics_router.address, "--dataset", "mooncake-conv",
                         "--num-requests", "6", "--length-scale", "0.0625", "--max-concurrency", "1",
                         "--no-progress", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["completed"] == 6 and doc["summary"]["failed"] == 0
    cached = [r["cached_tokens"] for r in doc["requests"]]
    assert cached[0] == 0 and cached[1:] == [32] * 5
    assert doc["summary"]["cached_tokens"] == 32 * 5
