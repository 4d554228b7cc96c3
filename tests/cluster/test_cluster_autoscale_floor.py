"""The slow loop's simulator floor (config `autoscale.floor: simulator`) on a real local Ray: in
advisory mode, a colocated pool serving a steady trickle of streams; after the slow window,
router 0's planner runs `python -m planning.floor` and logs an `autoscale_floor` line whose
floors come from the simulator, with the window's request-log figures (samples, length spread,
prefix hits); the floor metric is exported; the router's process never loaded planning.

Slow (about 50 s): the default run covers the same evaluation through a real subprocess and a
real Autoscaler in process (tests/unit/test_autoscale.py), and the planner's imports."""
from __future__ import annotations

import json
import time

import grpc
import pytest

from planning.latency import LatencyModel
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc
from tests.cluster.test_cluster_autoscale import autoscale_config, decisions, scrape
from tests.cluster.test_cluster_scale import open_streams
from tests.helpers import random_prompts, wait_until


@pytest.mark.slow
def test_the_slow_loop_runs_the_simulator_floor_in_router_0(tmp_path):
    import ray

    from cluster.runtime import Cluster

    profile = tmp_path / "profile.json"
    lm = LatencyModel(prefill=(0.01, 1.5e-4, 1e-8, 0.0), decode=(0.015, 0.002, 2e-7), kv_bytes_per_token=6144)
    profile.write_text(json.dumps({"latency_model": lm.to_json()}))
    cfg = autoscale_config("advisory")
    auto = {**cfg.autoscale.model_dump(), "slo": {"ttft_s": 5.0, "itl_s": 1.0, "percentile": 90},
            "slow_interval_s": 10.0, "floor": "simulator", "profile": str(profile), "floor_budget_s": 1.0,
            "floor_timeout_s": 9.0}
    cfg = cfg.model_validate({**cfg.model_dump(), "autoscale": auto})
    profile.unlink()  # its content travels with the config
    c = Cluster(cfg, on_event=lambda e: None)
    c.start()
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(c.router_address))
        t0 = time.monotonic()
        seed = 0
        while time.monotonic() - t0 < 12.0:  # streams finishing all through the first slow window
            futs, _ = open_streams(stub, random_prompts([16, 24], 2048, seed=seed), 8)
            [f.result(timeout=120) for f in futs]
            seed += 1

        def floor_line():
            return next((d for d in decisions(c) if d["event"] == "autoscale_floor"), None)
        line = wait_until(floor_line, 40, 0.2, "an autoscale_floor line")
        assert line["source"] == "simulator", line
        assert line["window"]["samples"] > 0 and line["window"]["prompt_cv"] is not None
        assert line["simulator"]["floors"] == line["floors"] and line["simulator"]["candidates"]
        assert f'pdcluster_autoscale_floor_replicas{{pool="colocated"}} {line["floors"]["colocated"]:.1f}' \
            in scrape(c)
        assert ray.get(c.routers[0].actor.loaded_modules.remote(["planning", "torch"]), timeout=30) == []
    finally:
        c.stop()
