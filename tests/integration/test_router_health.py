"""A worker busy in a long engine step answers its load late; the router must keep placing on
it (late is not dead) and take it out of placement only after `worker_timeout_s` of
silence. Real in-process prefill and decode workers (tiny llama, local KV transfer) behind the
real gRPC router; the prefill worker's engine thread is held busy for a fixed time, which is
what a multi-second prefill step does to it (its load is answered between steps).

A 2 s load timeout taken for death during a long prefill step marks the only prefill worker
unhealthy, and every request fails with UNAVAILABLE "no healthy prefill worker"."""
from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_transfer import TransferConfig
from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import (Loop, LoopKiller, close, collect, hold_engine_thread, local_pair, local_trio, per_worker, scrape,
                           stub, wait_until)

S = pb.SamplingParams


@pytest.fixture
def router(tiny_model, request):
    model = tiny_model("llama")
    prefill, decode, ph, dh = local_pair(model, 64, getattr(request, "param", None))
    loop = Loop()
    server = build_router(model, [ph], [dh], max_model_len=256)
    server.load_timeout_s = 0.05  # loads answered later than this are "late"
    server.metrics_port = 0
    loop.run(server.start())
    yield server, ph, (prefill, decode)
    loop.run(server.stop(1.0))
    close(ph, dh)
    loop.close()


def pages_back(*workers) -> None:
    """Every page of every worker comes back (a cancel or a transfer's release may still run)."""
    wait_until(lambda: all(w.core.num_free_pages == w.core.num_pages for w in workers), 10, 0.01,
               "every page back on every worker")


def request(n: int = 20) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=list(range(3, 3 + n)), sampling=S(max_tokens=4, temperature=0,
                                                                                  ignore_eos=True))


def test_busy_prefill_worker_is_late_not_dead(router):
    server, ph, workers = router
    dispatcher = server.service.dispatcher
    busy = hold_engine_thread(ph, 1.2)
    # several load refreshes go unanswered while the worker is busy
    wait_until(lambda: time.monotonic() - dispatcher._answered.get("prefill-0", 0.0) > 4 * server.load_refresh_s,
               5, 0.01, "prefill-0 silent for several refreshes")
    ids, _, last = collect(stub(server), request())  # a timeout taken for death: UNAVAILABLE "no healthy prefill worker"
    busy.result(10)
    assert len(ids) == 4 and last.finish_reason == "length"
    views = dispatcher.views
    assert views["prefill-0"].healthy and views["prefill-0"].error == ""
    assert per_worker(scrape(server.metrics_url), "pdcluster_worker_healthy") == {"prefill-0": 1.0, "decode-0": 1.0}
    pages_back(*workers)


def test_silent_prefill_worker_leaves_placement_then_returns(router):
    server, ph, workers = router
    server.service.dispatcher.worker_timeout_s = 0.3
    busy = hold_engine_thread(ph, 2.5)
    view = server.service.dispatcher.views["prefill-0"]
    wait_until(lambda: not view.healthy, 5, 0.01, "prefill-0 out of placement")
    assert "no load answer" in view.error
    states = {dict(k[1])["state"]: v for k, v in scrape(server.metrics_url).items()
              if k[0] == "pdcluster_worker_state" and dict(k[1])["worker"] == "prefill-0"}
    assert states["unresponsive"] == 1.0 and sum(states.values()) == 1.0, states
    with pytest.raises(grpc.RpcError) as err:
        collect(stub(server), request())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy prefill worker" in err.value.details()
    busy.result(10)
    wait_until(lambda: view.healthy, 5, 0.01, "prefill-0 back in placement once its pending load answers")
    ids, _, last = collect(stub(server), request(30))
    assert len(ids) == 4 and last.finish_reason == "length"
    pages_back(*workers)  # the refused request's decode pages are freed by a cancel task


@pytest.mark.parametrize("router", [TransferConfig(deadline_s=0.4)], indirect=True)
def test_prefill_queue_longer_than_the_transfer_deadline_is_not_a_failure(router):
    """A request waits in a busy prefill worker's queue for longer than the KV transfer
    deadline; the decode worker's reserved pages wait for the transfer to begin (bounded by the
    begin timeout), so the request is served, only later. A deadline running from the decode
    admission would fail requests queued behind long prefills with UNAVAILABLE "no healthy
    prefill worker left to retry on"."""
    server, ph, workers = router
    busy = hold_engine_thread(ph, 1.2)  # three transfer deadlines of queueing
    ids, _, last = collect(stub(server), request())
    assert busy.done(), "served only once the busy step was over: it did wait behind it"
    assert len(ids) == 4 and last.finish_reason == "length"
    pages_back(*workers)


def test_a_burst_is_spread_over_decode_workers_busy_in_a_step(tiny_model):
    """Six requests arrive while both decode workers are inside an engine step (a worker
    answers admits between steps). Each placement must count at once, so the burst splits 3/3:
    counted only once the worker's admit returned, every request of the burst would see equal
    counts and all six would go to the first worker (on a colocated cluster, to the worker
    stuck in a long prefill)."""
    from concurrent.futures import ThreadPoolExecutor

    model = tiny_model("llama")
    (prefill, decode0, decode1), (ph, dh0, dh1) = local_trio(model)
    loop = Loop()
    server = build_router(model, [ph], [dh0, dh1], max_model_len=256)
    loop.run(server.start())
    try:
        busy = [hold_engine_thread(h, 0.8) for h in (dh0, dh1)]
        with ThreadPoolExecutor(6) as pool:
            lasts = [f.result()[2] for f in [pool.submit(collect, stub(server), request(20 + i)) for i in range(6)]]
        for t in busy:
            t.result(10)
        placed = sorted(last.placement.decode_worker for last in lasts)
        assert placed == ["decode-0"] * 3 + ["decode-1"] * 3
        pages_back(prefill, decode0, decode1)
    finally:
        loop.run(server.stop(1.0))
        close(ph, dh0, dh1)
        loop.close()


def test_a_dead_engine_loop_is_reported_at_once_and_health_says_not_serving(router):
    """A worker whose engine loop has died answers every call at once with the reason: its
    load refresh takes it out of placement, the request it held ends with UNAVAILABLE instead
    of waiting for its deadline, and grpc.health.v1 says NOT_SERVING while no prefill worker is
    healthy."""
    server, ph, workers = router
    prefill = workers[0]
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))

    def serving() -> int:
        return health.Check(health_pb2.HealthCheckRequest(service="pdcluster.v1.Inference")).status

    assert serving() == health_pb2.HealthCheckResponse.SERVING

    def die():
        raise LoopKiller("injected")

    prefill.step = die  # the next step this worker takes kills its loop
    with pytest.raises(grpc.RpcError) as err:
        collect(stub(server), request(), timeout=60)  # a deadline far away: only the loss ends it early
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    view = server.service.dispatcher.views["prefill-0"]
    wait_until(lambda: not view.healthy, 5, 0.01, "prefill-0 out of placement")
    assert "engine loop died" in view.error and "LoopKiller" in view.error
    wait_until(lambda: serving() == health_pb2.HealthCheckResponse.NOT_SERVING, 5, 0.01, "health NOT_SERVING")
    assert "no healthy prefill worker" in server.missing_role()
    with pytest.raises(grpc.RpcError) as err:
        collect(stub(server), request(), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy prefill worker" in err.value.details()
    pages_back(workers[1])  # the decode worker freed the pages it had reserved
