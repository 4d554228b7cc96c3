"""The router's process killed mid-stream (kill -9), on a real local Ray: the clients' open
streams fail with UNAVAILABLE (never a wrong token), Ray restarts the router actor and the
cluster's supervisor starts it again: SERVING on the same port, the same greedy tokens as
before, and the requests its predecessor had running on the workers cancelled (every worker's
pages free again). With `router.replicas: 2`, requests through the other router go on while
one is out. `router.request_log` writes one JSON line per request."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.config import ClusterConfig
from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc
from tests.helpers import collect, our_ray_processes, wait_free, wait_until

S = pb.SamplingParams
# long streams: still running on the decode worker seconds after the kill unless cancelled
ENGINE = dict(num_pages=512, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=16, page_size=16)
SHORT = pb.GenerateRequest(prompt_token_ids=list(range(5, 25)), sampling=S(max_tokens=8, temperature=0,
                                                                           ignore_eos=True))
LONG = pb.GenerateRequest(prompt_token_ids=list(range(1, 40)), sampling=S(max_tokens=980, temperature=0,
                                                                          ignore_eos=True))
RETURN_S = 15.0  # the target; the assertion leaves slack for a shared CI machine
SLACK_S = 30.0


def _stub(address: str):
    return pb_grpc.InferenceStub(grpc.insecure_channel(address))


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return False
    return st == health_pb2.HealthCheckResponse.SERVING


def _open_streams(s, n: int) -> list:
    calls = [s.Generate(LONG, timeout=120) for _ in range(n)]
    heads = []
    for call in calls:
        heads.append(list(next(call).token_ids) + list(next(call).token_ids))  # the decode stream is open
    return list(zip(calls, heads))


def _fails_unavailable(call, head, reference) -> None:
    ids = list(head)
    try:
        for m in call:
            ids += m.token_ids
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, (exc.code(), exc.details())
    else:
        raise AssertionError("a stream of the killed router completed")
    assert ids == reference[:len(ids)], "a stream of the killed router carried a wrong token"


def _kill_router(cluster, index: int) -> tuple[int, float]:
    import ray

    actor = cluster.routers[index].actor
    pid = ray.get(actor.pid.remote(), timeout=30)
    os.kill(pid, signal.SIGKILL)
    return pid, time.monotonic()


def _start(tiny_model, tmp_path, **router):
    from cluster.runtime import Cluster

    tiny_model("llama")
    cfg = ClusterConfig.embedded(model="tiny", port=0, engine=ENGINE, prefill=1, decode=1, transport="nixl")
    cfg.router = cfg.router.model_copy(update=router)
    events: list[str] = []
    cluster = Cluster(cfg, on_event=events.append)
    cluster.start()
    return cluster, events


def test_a_killed_router_comes_back_on_its_port_and_its_requests_are_cancelled(tiny_model, tmp_path):
    log_path = tmp_path / "requests.jsonl"
    cluster, events = _start(tiny_model, tmp_path, request_log=str(log_path), http_port=0, metrics_port=0)
    try:
        import ray

        address, http_url, metrics_url = cluster.router_address, cluster.http_url, cluster.metrics_url
        assert http_url and metrics_url
        s = _stub(address)
        before, _, _ = collect(s, SHORT)
        reference, _, _ = collect(s, LONG)
        lines = [json.loads(x) for x in log_path.read_text().splitlines()]
        assert len(lines) == 2 and all(x["router"] == "router-0" and x["finish_reason"] == "length"
                                       and x["decode_worker"] == "decode-0" and x["prefill_worker"] == "prefill-0"
                                       for x in lines), lines
        assert [x["completion_tokens"] for x in lines] == [8, 980] and len({x["request_id"] for x in lines}) == 2

        streams = _open_streams(s, 4)
        st = s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        decode = next(w for w in st.workers if w.role == "decode")
        assert decode.running_requests == 4 and decode.free_pages < decode.total_pages, decode
        pid, killed = _kill_router(cluster, 0)
        for call, head in streams:
            _fails_unavailable(call, head, reference)
        wait_until(lambda: _serving(address), RETURN_S + SLACK_S, 0.05, f"the router SERVING again on {address}")
        back_s = time.monotonic() - killed
        print(f"\nrouter-0: killed -> SERVING again on {address} in {back_s:.1f} s")
        info = ray.get(cluster.routers[0].actor.info.remote(), timeout=30)
        assert info["pid"] != pid and info["address"] == address
        # the predecessor's streams were still running on the decode worker: the new router cancelled them
        assert info["retired"] == 4, info
        after, _, _ = collect(_stub(address), SHORT)
        assert after == before
        # its HTTP API and /metrics on their old (free-picked) ports too
        assert ray.get(cluster.routers[0].actor.http_url.remote(), timeout=30) == http_url
        assert ray.get(cluster.routers[0].actor.metrics_url.remote(), timeout=30) == metrics_url
        models = json.loads(urllib.request.urlopen(http_url + "/v1/models", timeout=10).read())
        assert models["data"], models
        assert b"pdcluster_requests" in urllib.request.urlopen(metrics_url, timeout=10).read()
        st = wait_free(_stub(address))
        assert all(w.free_pages == w.total_pages and w.running_requests == 0 for w in st.workers), st
        wait_until(lambda: any(e.startswith("router-0 back") for e in events), 30, 0.05, "the supervisor's line")
        assert any(e.startswith(f"router-0 lost (pid {pid})") for e in events), events
        assert not cluster.failure
        # the request log goes on in the new process: the 4 killed streams were never logged by it
        done = [json.loads(x) for x in log_path.read_text().splitlines()]
        assert len(done) == 3 and done[-1]["completion_tokens"] == 8, done
    finally:
        cluster.stop()
    assert not our_ray_processes()


def test_two_routers_one_killed_the_other_serves_on(tiny_model, tmp_path):
    cluster, events = _start(tiny_model, tmp_path, replicas=2)
    try:
        a0, a1 = cluster.router_addresses
        assert cluster.router_address == a0 and a0 != a1
        s0, s1 = _stub(a0), _stub(a1)
        before, _, _ = collect(s0, SHORT)
        reference, _, _ = collect(s1, LONG)
        killed_streams = _open_streams(s0, 2)
        other_streams = _open_streams(s1, 2)
        pid, killed = _kill_router(cluster, 0)
        for call, head in killed_streams:
            _fails_unavailable(call, head, reference)
        served_while_out = 0
        while not _serving(a0):  # router-1 serves while router-0 is out
            assert time.monotonic() - killed < RETURN_S + SLACK_S, "router-0 did not come back"
            got, _, last = collect(s1, SHORT)
            assert got == before and last.finish_reason == "length"
            served_while_out += 1
        print(f"\nrouter-0: killed -> SERVING again on {a0} in {time.monotonic() - killed:.1f} s; "
              f"router-1 served {served_while_out} requests meanwhile")
        assert served_while_out >= 1
        for call, head in other_streams:  # router-1's streams were never touched
            msgs = list(call)
            assert head + [t for m in msgs for t in m.token_ids] == reference
        assert collect(_stub(a0), SHORT)[0] == before
        st = wait_free(s1)
        assert all(w.free_pages == w.total_pages for w in st.workers), st
        assert any(e.startswith("router-0 back") for e in events) or wait_until(
            lambda: any(e.startswith("router-0 back") for e in events), 30, 0.05, "the supervisor's line")
        assert not any(e.startswith("router-1") for e in events), events
    finally:
        cluster.stop()
    assert not our_ray_processes()


@pytest.mark.slow  # ~25 s; the default run keeps a killed router's return (the same supervisor path)
def test_a_hung_router_is_killed_and_comes_back(tiny_model, tmp_path):
    """A router process stopped (SIGSTOP: alive to Ray, answering nothing) is killed by the
    supervisor once it has been silent for router.worker_timeout_s, and Ray restarts it."""
    import ray

    cluster, events = _start(tiny_model, tmp_path, worker_timeout_s=2.0)
    pid = 0
    try:
        address = cluster.router_address
        before, _, _ = collect(_stub(address), SHORT)
        pid = ray.get(cluster.routers[0].actor.pid.remote(), timeout=30)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(lambda: any(e.startswith(f"router-0 lost (pid {pid}): it answered nothing") for e in events),
                   2.0 + SLACK_S, 0.05, "the supervisor giving up on the stopped router")
        wait_until(lambda: _serving(address), RETURN_S + SLACK_S, 0.05, f"the router SERVING again on {address}")
        print(f"\nrouter-0: SIGSTOP -> SERVING again (a new process) on {address} in {time.monotonic() - stopped:.1f} s")
        assert ray.get(cluster.routers[0].actor.pid.remote(), timeout=30) != pid
        after, _, _ = collect(_stub(address), SHORT)
        assert after == before
        wait_until(lambda: any(e.startswith("router-0 back") for e in events), 30, 0.05, "the supervisor's line")
        assert not cluster.failure
    finally:
        if pid:
            try:
                os.kill(pid, signal.SIGCONT)  # if it is still there
            except ProcessLookupError:
                pass
        cluster.stop()
    assert not our_ray_processes()
