"""Moving a worker between the prefill and decode pools at run time (`pdcluster scale --move`),
on a real local Ray (loopback), through the Scale RPC, with greedy streams open: the least
loaded decode worker drains (a short grace: its open streams migrate to the other decode
worker), switches role inside its running process (same pid: its weights stay loaded), warms up
and serves as the prefill pool's newest worker; then one moves back. No request fails, every
stream's tokens equal engine.LLM greedy, requests are placed on the moved worker in its new
role, every page is free after, ClusterStatus shows the pools' targets and the worker's states
(draining, switching, warming) with the pool it is moving to. Invalid moves are
INVALID_ARGUMENT naming the field and the allowed range."""
from __future__ import annotations

import argparse

import grpc
import pytest

from cluster.scale import add_arguments, run
from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc
from tests.cluster.test_cluster_scale import Watch, _all_free, check_equal, open_streams, pool_of, scale_config
from tests.helpers import our_ray_processes, random_prompts, wait_until

TOKENS = 200
N = 12


def test_move_a_decode_worker_to_prefill_and_back_under_streams(tiny_model, make_llm):
    from cluster.runtime import Cluster

    cfg = scale_config("disaggregated", ["--prefill", "1", "--decode", "2"])
    names = {p.role: p.name for p in cfg.pools}
    pre, dec = names["prefill"], names["decode"]
    model = tiny_model("llama")
    events: list[str] = []
    c = Cluster(cfg, drain_grace_s=0.5, on_event=events.append)
    c.start()
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(c.router_address))
    watch = Watch(stub, dec)
    try:
        for req, said in ((pb.ScaleRequest(pool=dec, move=1, to_pool="nope"), "to_pool must be one of"),
                          (pb.ScaleRequest(pool=dec, move=1, to_pool=dec), "to_pool must be one of"),
                          (pb.ScaleRequest(pool=dec, move=2, to_pool=pre), "move must be in [1, 1]"),
                          (pb.ScaleRequest(pool=pre, move=1, to_pool=dec), "no worker can move now")):
            with pytest.raises(grpc.RpcError) as e:
                stub.Scale(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and said in e.value.details(), e.value
        st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        pids = {w.worker_id: w.pid for w in st.workers}

        # streams open on both decode workers while one of them moves to the prefill pool
        prompts = random_prompts([5 + 3 * i for i in range(N)], 2048, seed=11)
        futs, started = open_streams(stub, prompts, TOKENS)
        wait_until(lambda: started[0] == N, 60, 0.01, "streaming")
        resp = stub.Scale(pb.ScaleRequest(pool=dec, move=1, to_pool=pre), timeout=10)
        assert (resp.previous_target, resp.target, resp.to_pool, resp.to_previous_target, resp.to_target) == \
            (2, 1, pre, 1, 2), resp
        moved_in = f"{pre}-1"  # the prefill pool's newest worker
        wait_until(lambda: (moved_in, "serving") in watch.states and pool_of(watch.last, pre).current_replicas == 2,
                   120, 0.01, "the moved worker serving as a prefill worker")
        got = [f.result(timeout=300) for f in futs]
        seen = {s for w, s in watch.states}
        assert {"draining", "warming"} <= seen, watch.states  # "switching" lasts a few ms: seen or not
        line = next(e for e in events if "now serves as" in e)
        old_id = line.split()[1]
        assert old_id in (f"{dec}-0", f"{dec}-1") and f"as {moved_in} of pool {pre}" in line, line
        st = wait_until(lambda: _all_free(stub, ()), 30, 0.05, "every page free")
        by_id = {w.worker_id: w for w in st.workers}
        assert by_id[moved_in].pid == pids[old_id], "the moved worker kept its process"
        assert by_id[moved_in].role == "prefill" and by_id[moved_in].moving_to == ""
        assert (pool_of(st, pre).target_replicas, pool_of(st, pre).current_replicas) == (2, 2)
        assert (pool_of(st, dec).target_replicas, pool_of(st, dec).current_replicas) == (1, 1)
        ends = [(last.placement.decode_worker, last.placement.migrations) for _, _, last in got]
        stayed = ({f"{dec}-0", f"{dec}-1"} - {old_id}).pop()
        assert all(m == 0 or (w == stayed and m == 1) for w, m in ends), ends

        # the moved worker prefills new requests; then it (or the other prefill worker) moves back
        prompts2 = random_prompts([7 + 3 * i for i in range(N)], 2048, seed=12)
        futs2, started2 = open_streams(stub, prompts2, TOKENS)
        wait_until(lambda: started2[0] == N, 60, 0.01, "wave 2 streaming")
        # this time through the CLI, which waits until both pools have their targets
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        assert run(parser.parse_args(["--address", c.router_address, "--move", "1", "--from", pre, "--to", dec,
                                      "--wait", "120"])) == 0
        assert sum("now serves as" in e for e in events) == 2, events
        got2 = [f.result(timeout=300) for f in futs2]
        assert watch.placed.get(moved_in, 0) > 0, watch.placed
        llm = make_llm(model, page_size=16, num_pages=2048, max_model_len=1024)
        check_equal(got, llm, prompts, TOKENS)
        check_equal(got2, llm, prompts2, TOKENS)
        st = wait_until(lambda: _all_free(stub, ()), 30, 0.05, "every page free")
        assert st.requests_failed == 0 and st.requests_served >= 2 * N, st
        # the router's KV index followed the workers through Ray and both moves: exact for every one
        st = wait_until(lambda: (lambda s: s if s.kv_index_exact else None)(
            stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)), 10, 0.1, "the KV index exact")
        assert all(w.kv_index_state == "exact" for w in st.workers if w.state == "serving"), st.workers
        assert st.kv_index_blocks > 0
        serving = sorted((w.pool, w.pid) for w in st.workers if w.state == "serving")
        assert sorted(p for _, p in serving) == sorted(pids.values()), "three processes from start to end"
        print("\n".join(events))
    finally:
        watch.close()
        c.stop()
    assert not our_ray_processes(), "Ray processes left after stop"


@pytest.mark.slow
def test_a_moved_worker_restarted_by_ray_comes_back_in_its_new_role(tiny_model, make_llm):
    """The moved worker's process is killed (SIGKILL): Ray restarts the actor with the spec it
    was created with (a decode worker), which must come back as what it was moved to (the role
    switch is recorded per actor in Ray's KV store): the router warms it up as a prefill worker
    and places prefills on it again; greedy tokens stay identical."""
    import os
    import signal

    from cluster.runtime import Cluster

    cfg = scale_config("disaggregated", ["--prefill", "1", "--decode", "2"])
    names = {p.role: p.name for p in cfg.pools}
    pre, dec = names["prefill"], names["decode"]
    model = tiny_model("llama")
    c = Cluster(cfg)
    c.start()
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(c.router_address))
    try:
        c.move(dec, pre)
        moved = f"{pre}-1"
        st = wait_until(lambda: (lambda s: s if any(w.worker_id == moved and w.state == "serving" for w in s.workers)
                                 else None)(stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)),
                        120, 0.05, "moved")
        pid = next(w.pid for w in st.workers if w.worker_id == moved)
        os.kill(pid, signal.SIGKILL)

        def back():
            s = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
            w = next(w for w in s.workers if w.worker_id == moved)
            return w if w.state == "serving" and w.pid not in (0, pid) and w.restarts >= 1 else None
        w = wait_until(back, 180, 0.1, "the moved worker restarted and serving")
        assert w.role == "prefill", w
        prompts = random_prompts([9 + 4 * i for i in range(8)], 2048, seed=21)
        futs, _ = open_streams(stub, prompts, 40)
        got = [f.result(timeout=300) for f in futs]
        check_equal(got, make_llm(model, page_size=16, num_pages=2048, max_model_len=1024), prompts, 40)
        st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        assert next(x for x in st.workers if x.worker_id == moved).requests_placed > 0, st.workers
        assert st.requests_failed == 0
        wait_until(lambda: _all_free(stub, ()), 30, 0.05, "every page free")
    finally:
        c.stop()
    assert not our_ray_processes(), "Ray processes left after stop"
