"""The router's /metrics endpoint, in one process in front of real prefill and decode workers
over the `local` transport: latency histograms count exactly the requests and chunks sent,
finish reasons and error codes are counted, the KV transfer bytes equal the decode pages the
prompts filled (read off the decode worker's own KV tensors), KV gauges per worker add up
(used + free = total) and used pages fall back to the idle level once the requests finish; one
JSON log line per finished request."""
from __future__ import annotations

import json
import logging
import threading

import grpc
import pytest

from proto.pdcluster.v1 import inference_pb2 as pb
from tests.helpers import collect, kv_bytes_moved, per_worker, scrape, stub, value, wait_until

S = pb.SamplingParams
LONG = 200  # tokens of the long stream: long enough that a 0.1 s load refresh sees its pages


def test_metrics_count_requests_chunks_errors_and_pages(metrics_cluster, caplog):
    metrics_router, _, decode = metrics_cluster
    url = metrics_router.metrics_url
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    idle = scrape(url)
    idle_used = per_worker(idle, "pdcluster_kv_pages_used")
    assert set(idle_used) == {"prefill-0", "decode-0"}
    s = stub(metrics_router)
    long_req = pb.GenerateRequest(prompt_token_ids=list(range(1, 41)),
                                  sampling=S(max_tokens=LONG, temperature=0, ignore_eos=True))
    chunks_long: list = []
    t = threading.Thread(target=lambda: chunks_long.extend(s.Generate(long_req, timeout=60)))
    caplog.set_level(logging.INFO, logger="pdcluster.requests")
    t.start()

    def while_it_streams() -> dict | None:
        # worker gauges lag by one load refresh (0.1 s): a scrape that shows the request's pages
        snap = scrape(url)
        busy = (value(snap, "pdcluster_router_running_requests") >= 1
                and per_worker(snap, "pdcluster_kv_pages_used")["decode-0"] > idle_used["decode-0"])
        return snap if busy else None

    wait_until(while_it_streams, 30, 0.02, "a scrape that sees the long request running with its decode pages in use")
    responses = [list(s.Generate(pb.GenerateRequest(prompt_token_ids=list(range(2, 2 + n)), sampling=S(
        max_tokens=k, temperature=0, ignore_eos=True)), timeout=60)) for n, k in ((5, 3), (20, 3), (3, 1))]
    with pytest.raises(grpc.RpcError) as err:
        collect(s, pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=S(max_tokens=3, temperature=-1)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    t.join(60)
    responses.append(chunks_long)
    # once the workers' loads are refreshed after the last request, their pages are back
    after = wait_until(lambda: (snap := scrape(url)) and per_worker(snap, "pdcluster_kv_pages_used") == idle_used
                       and snap, 10, 0.02, "the worker gauges back at their idle page use")
    n_ok = 4
    assert value(after, "pdcluster_request_ttft_seconds_count") == n_ok
    assert value(after, "pdcluster_request_e2e_seconds_count") == n_ok
    assert value(after, "pdcluster_requests_total", finish_reason="length") == n_ok
    assert value(after, "pdcluster_request_errors_total", code="INVALID_ARGUMENT") == 1
    assert value(after, "pdcluster_generation_tokens_total") == LONG + 3 + 3 + 1
    assert value(after, "pdcluster_prompt_tokens_total") == 40 + 5 + 20 + 3
    # every request here was prefilled on prefill-0 and its KV moved into decode-0's pages
    assert value(after, "pdcluster_kv_transfer_bytes_count") == n_ok
    assert value(after, "pdcluster_kv_transfer_bytes_sum") == kv_bytes_moved(decode, (40, 5, 20, 3)) > 0
    assert value(after, "pdcluster_kv_transfer_seconds_count") == n_ok
    # every gap between token-bearing chunks sent (what a client measures as ITL); text-only
    # chunks and the last response (usage only) are not gaps
    gaps = sum(sum(1 for c in r if c.token_ids) - 1 for r in responses)
    assert gaps >= 2 and value(after, "pdcluster_request_itl_seconds_count") == gaps
    assert value(after, "pdcluster_router_running_requests") == 0
    for name in ("pdcluster_kv_pages_used", "pdcluster_kv_pages_free", "pdcluster_kv_pages_total"):
        assert set(per_worker(after, name)) == {"prefill-0", "decode-0"}
    used, free, total = (per_worker(after, f"pdcluster_kv_pages_{k}") for k in ("used", "free", "total"))
    for w in total:
        assert used[w] + free[w] == total[w] > 0
    assert used == idle_used
    assert per_worker(after, "pdcluster_worker_healthy") == {"prefill-0": 1.0, "decode-0": 1.0}
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "pdcluster.requests"]
    done = [l for l in lines if "finish_reason" in l]
    assert len(done) == n_ok and all(l["prefill_worker"] == "prefill-0" and l["e2e_s"] >= l["ttft_s"] > 0 for l in done)
    assert {l["completion_tokens"] for l in done} == {LONG, 3, 1}
    assert sorted(l["kv_bytes"] for l in done) == sorted(kv_bytes_moved(decode, (n,)) for n in (40, 5, 20, 3))
