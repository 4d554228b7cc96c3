"""Drain: health says NOT_SERVING at once and the listener stays open, new requests are refused
with UNAVAILABLE "draining", running streams finish within the grace; past it they are
cancelled with a message saying so, and every page comes back. Real in-process prefill and
decode workers (tiny llama, local KV transfer) behind the real gRPC router."""
from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import Loop, close, collect, local_pair, slow_steps, stub, wait_until

S = pb.SamplingParams
LONG = pb.GenerateRequest(prompt_token_ids=list(range(3, 30)), sampling=S(max_tokens=150, temperature=0,
                                                                          ignore_eos=True))


@pytest.fixture
def router(tiny_model):
    model = tiny_model("llama")
    prefill, decode, ph, dh = local_pair(model, 64)
    loop = Loop()
    server = build_router(model, [ph], [dh], max_model_len=256)
    loop.run(server.start())
    yield server, loop, (prefill, decode)
    loop.run(server.stop(1.0))
    close(ph, dh)
    loop.close()


def started_stream(server):
    """A long greedy stream with its first tokens received, running in a thread: (thread, result)."""
    result: dict = {}
    first = threading.Event()

    def run():
        ids = []
        try:
            for msg in stub(server).Generate(LONG, timeout=120):
                ids += msg.token_ids
                first.set()
                if msg.finish_reason:
                    result["final"] = msg
        except grpc.RpcError as exc:
            result["error"] = exc
        result["ids"] = ids
        first.set()

    t = threading.Thread(target=run)
    t.start()
    assert first.wait(60)
    return t, result


def health(server) -> int:
    return health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address)).Check(
        health_pb2.HealthCheckRequest(service="pdcluster.v1.Inference"), timeout=5).status


def test_a_drain_lets_running_streams_finish_and_refuses_new_ones(router):
    server, loop, (prefill, decode) = router
    want, _, _ = collect(stub(server), LONG)
    slow_steps(decode, 0.01)  # the stream runs ~1.5 s: the drain begins while it does
    t, result = started_stream(server)
    drain = stub(server).Drain.future(pb.DrainRequest(grace_s=60), timeout=90)
    wait_until(lambda: health(server) == health_pb2.HealthCheckResponse.NOT_SERVING, 5, 0.01, "NOT_SERVING")
    with pytest.raises(grpc.RpcError) as err:
        collect(stub(server), LONG)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
    assert stub(server).ModelInfo(pb.ModelInfoRequest(), timeout=5).vocab_size > 0  # the listener is open
    resp = drain.result()
    t.join(60)
    assert resp.finished == 1 and resp.cancelled == 0
    assert result["ids"] == want and result["final"].finish_reason == "length"
    for w in (prefill, decode):
        wait_until(lambda w=w: w.core.num_free_pages == w.core.num_pages, 10, 0.01, "pages back")


def test_past_the_grace_running_streams_are_cancelled_saying_so(router):
    server, loop, (prefill, decode) = router
    slow_steps(decode, 0.05)  # ~7 s of stream: longer than the grace
    t, result = started_stream(server)
    finished, cancelled = loop.run(server.service.drain(0.3))
    t.join(30)
    assert (finished, cancelled) == (0, 1)
    err = result["error"]
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "grace of 0.3 s ran out" in err.details()
    for w in (prefill, decode):
        wait_until(lambda w=w: w.core.num_free_pages == w.core.num_pages, 10, 0.01, "pages back")


@pytest.mark.parametrize("grace", [-1.0, 1e9, float("nan")])
def test_a_drain_with_a_grace_out_of_range_is_invalid(router, grace):
    server, _, _ = router
    with pytest.raises(grpc.RpcError) as err:
        stub(server).Drain(pb.DrainRequest(grace_s=grace), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grace_s" in err.value.details()
    assert health(server) == health_pb2.HealthCheckResponse.SERVING
