"""The SLA planner (cluster.autoscale) on a real local Ray (loopback): a colocated pool, min 1
max 2, under an ITL objective no CPU worker meets. Mode `on`: a burst of greedy streams makes
the planner scale the pool out to 2 (the cluster's scaler starts and warms the worker), and
with no traffic it goes back to 1; no request fails and every stream's tokens equal engine.LLM
greedy. Mode `advisory`: the planner logs an up decision and sets the desired metric, and the
pool's target never moves."""
from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest

from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc
from tests.cluster.test_cluster_scale import Watch, check_equal, open_streams, pool_of, scale_config
from tests.helpers import our_ray_processes, random_prompts, wait_until

TOKENS = 64
N = 8


def autoscale_config(mode: str):
    cfg = scale_config("colocated", ["--decode", "1"])
    auto = {"mode": mode, "pools": {"colocated": {"min_replicas": 1, "max_replicas": 2}},
            # no CPU worker streams a chunk every millisecond: every window with traffic misses
            "slo": {"ttft_s": 30.0, "itl_s": 0.001, "percentile": 90},
            "interval_s": 0.5, "window_s": 2.0, "up_cooldown_s": 0.0, "down_cooldown_s": 1.0,
            "slow_interval_s": 60.0}
    return cfg.model_validate({**cfg.model_dump(), "autoscale": auto,
                               "router": {**cfg.router.model_dump(), "metrics_port": 0}})


def decisions(c) -> list[dict]:
    import ray

    lines = ray.get(c.routers[0].actor.autoscale_decisions.remote(0), timeout=10)
    return [json.loads(line) for _, line in lines]


def scrape(c) -> str:
    return urllib.request.urlopen(c.metrics_url, timeout=10).read().decode()


def test_autoscale_on_scales_out_under_a_burst_and_back_to_min_when_idle(tiny_model, make_llm):
    from cluster.runtime import Cluster

    cfg = autoscale_config("on")
    model = tiny_model("llama")
    events: list[str] = []
    c = Cluster(cfg, on_event=events.append)
    c.start()
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(c.router_address))
        watch = Watch(stub, "colocated")
        try:
            assert (pool_of(stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10), "colocated").target_replicas
                    == 1)
            prompts = random_prompts([5 + 3 * i for i in range(N)], 2048, seed=7)
            t0 = time.monotonic()
            futs, started = open_streams(stub, prompts, TOKENS)
            wait_until(lambda: (2, 1) in watch.pool_seen, 30, 0.01, "the planner set target 2")
            up_s = time.monotonic() - t0
            wait_until(lambda: (2, 2) in watch.pool_seen, 60, 0.01, "the second worker serving")
            serving_s = time.monotonic() - t0
            got = [f.result(timeout=300) for f in futs]
            # a second burst lands on both workers
            prompts2 = random_prompts([4 + 2 * i for i in range(N)], 2048, seed=8)
            futs2, _ = open_streams(stub, prompts2, 24)
            got2 = [f.result(timeout=300) for f in futs2]
            t1 = time.monotonic()
            wait_until(lambda: any(s == "stopped" for _, s in watch.states), 60, 0.01, "back at 1 worker")
            idle_s = time.monotonic() - t1
            st = wait_until(lambda: (lambda s: s if (pool_of(s, "colocated").target_replicas,
                                                     pool_of(s, "colocated").current_replicas) == (1, 1) else None)(
                stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)), 30, 0.05, "pool at (1, 1)")
        finally:
            watch.close()
        assert st.requests_failed == 0 and st.requests_served >= 2 * N, st
        assert watch.placed.get("colocated-1", 0) > 0, watch.placed
        llm = make_llm(model, page_size=16, num_pages=2048, max_model_len=1024)
        check_equal(got, llm, prompts, TOKENS)
        check_equal(got2, llm, prompts2, 24)
        ds = decisions(c)
        moves = [(d["direction"], d["reason"], d["target"], d["desired"], d["applied"]) for d in ds
                 if d.get("event") == "autoscale" and d["direction"] != "hold"]
        assert moves[0] == ("up", "itl_slo", 1, 2, True), moves
        assert ("down", "idle", 2, 1, True) in moves, moves
        up = next(d for d in ds if d.get("direction") == "up")
        assert up["inputs"]["itl_s"] > 0.001 and up["inputs"]["slo_itl_s"] == 0.001, up
        text = scrape(c)
        assert 'pdcluster_autoscale_decisions_total{direction="up",pool="colocated",reason="itl_slo"} 1.0' in text
        assert 'pdcluster_autoscale_desired_replicas{pool="colocated"} 1.0' in text
        # the driver logged the planner's lines (what `serve` prints)
        wait_until(lambda: any(e.startswith("autoscale: ") and '"direction":"down"' in e for e in events), 10, 0.05,
                   "the driver logged the down decision")
        print(f"figures: target 2 set {up_s:.1f} s after the burst began, second worker serving after "
              f"{serving_s:.1f} s; back at 1 worker {idle_s:.1f} s after the last stream ended")
        print("\n".join(e for e in events if "pool colocated" in e or '"direction":"down"' in e
                        or '"direction":"up"' in e))
    finally:
        c.stop()
    assert not our_ray_processes(), "Ray processes left after stop"


@pytest.mark.slow
def test_autoscale_advisory_logs_but_the_pool_stays(tiny_model):
    from cluster.runtime import Cluster

    cfg = autoscale_config("advisory")
    tiny_model("llama")
    c = Cluster(cfg)
    c.start()
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(c.router_address))
        watch = Watch(stub, "colocated")
        try:
            prompts = random_prompts([5 + 3 * i for i in range(N)], 2048, seed=9)
            futs, _ = open_streams(stub, prompts, TOKENS)
            wait_until(lambda: any(d.get("direction") == "up" for d in decisions(c)), 60, 0.05, "an up decision")
            assert 'pdcluster_autoscale_desired_replicas{pool="colocated"} 2.0' in scrape(c)
            [f.result(timeout=300) for f in futs]
            st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        finally:
            watch.close()
        up = next(d for d in decisions(c) if d.get("direction") == "up")
        assert (up["mode"], up["reason"], up["applied"]) == ("advisory", "itl_slo", False), up
        assert watch.pool_seen == {(1, 1)}, watch.pool_seen
        assert (pool_of(st, "colocated").target_replicas, pool_of(st, "colocated").current_replicas) == (1, 1)
        assert st.requests_failed == 0 and {w.worker_id for w in st.workers} == {"colocated-0"}
    finally:
        c.stop()
    assert not our_ray_processes(), "Ray processes left after stop"
