"""A decode worker that answers nothing (its engine thread held, as a stopped process or a stuck
step would) behind the real gRPC router, with real in-process workers (tiny llama, local KV
transfer) and `worker_timeout_s` 0.5 s: it is `unresponsive` within the timeout, the stream on
it continues on the other decode worker with exactly the tokens of an uninterrupted run, and
once it answers again (the cancels it was owed sent, a warm-up) it is placed on again, or, with
a hot spare promoted in its place, becomes the spare. Every page comes back (the page-leak
check of tests/conftest.py runs after each test). The Ray suite stops real processes
(tests/cluster/test_cluster_ray_hung_worker.py)."""
from __future__ import annotations

import threading
import time

import pytest

from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import Loop, close, collect, hold_engine_thread, local_trio, slow_steps, stub, wait_until

S = pb.SamplingParams
TIMEOUT_S = 0.5


@pytest.fixture
def cluster(tiny_model, request):
    """1 prefill + 2 decode workers; request.param: router keyword arguments."""
    model = tiny_model("llama")
    (prefill, decode0, decode1), handles = local_trio(model)
    for w in (decode0, decode1):
        slow_steps(w, 0.01)  # a stream is still decoding when the test acts
    loop = Loop()
    server = build_router(model, [handles[0]], list(handles[1:]), max_model_len=256, worker_timeout_s=TIMEOUT_S,
                          **getattr(request, "param", {}))
    loop.run(server.start())
    yield server, dict(zip(("prefill-0", "decode-0", "decode-1"), handles))
    loop.run(server.stop(1.0))
    close(*handles)
    loop.close()


def request() -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=list(range(3, 30)),
                              sampling=S(max_tokens=150, temperature=0, ignore_eos=True))


def hang_mid_stream(server, handles, hold_s: float):
    """Run request(); once it streams, hold its decode worker's engine thread for hold_s.
    Returns (ids, final message, held worker id, seconds from the hold to `unresponsive`)."""
    views = server.service.dispatcher.views
    call = stub(server).Generate(request(), timeout=60)
    ids = list(next(call).token_ids) + list(next(call).token_ids)
    holder = next(w for w in ("decode-0", "decode-1") if views[w].inflight)
    t0 = time.monotonic()
    hold_engine_thread(handles[holder], hold_s)
    seen = []
    watcher = threading.Thread(target=lambda: seen.append(
        wait_until(lambda: views[holder].state == "unresponsive" and time.monotonic(), 5, 0.005, "unresponsive")))
    watcher.start()
    msgs = list(call)
    watcher.join(10)
    return ids + [t for m in msgs for t in m.token_ids], msgs[-1], holder, seen[0] - t0


def test_a_hung_decode_worker_is_given_up_on_its_stream_migrates_and_it_returns(cluster):
    server, handles = cluster
    ref = collect(stub(server), request())[0]
    views = server.service.dispatcher.views
    ids, last, holder, detect_s = hang_mid_stream(server, handles, 3.0)
    assert ids == ref, "the migrated stream lost, repeated or changed tokens"
    assert last.placement.migrations == 1 and last.placement.decode_worker != holder
    assert detect_s <= TIMEOUT_S + 1.0, detect_s
    view = views[holder]
    assert view.state == "unresponsive" and not view.healthy and "no load answer and no output" in view.last_error
    wait_until(lambda: view.state == "serving" and view.healthy, 15, 0.01, f"{holder} back after its warm-up")
    assert "unresponsive for" in view.last_error and view.restarts == 0
    pinned = pb.GenerateRequest(prompt_token_ids=list(request().prompt_token_ids), decode_worker=holder,
                                sampling=S(max_tokens=20, temperature=0, ignore_eos=True))
    assert collect(stub(server), pinned)[0] == ref[:20]


@pytest.mark.parametrize("cluster", [{"spares": ["decode-1"]}], indirect=True)
def test_a_spare_takes_the_hung_workers_place_and_it_becomes_the_spare(cluster):
    server, handles = cluster
    views = server.service.dispatcher.views
    assert (views["decode-0"].state, views["decode-1"].state) == ("serving", "spare")
    ref = collect(stub(server), request())[0]
    assert views["decode-1"].placed == 0  # a spare takes nothing
    ids, last, holder, _ = hang_mid_stream(server, handles, 3.0)
    assert holder == "decode-0" and ids == ref
    assert last.placement.decode_worker == "decode-1" and views["decode-1"].state == "serving"
    wait_until(lambda: views["decode-0"].state == "spare", 15, 0.01, "decode-0 back, as the spare")
    assert not views["decode-0"].healthy
    assert collect(stub(server), request())[0] == ref
