"""A worker that answers nothing (its process stopped with SIGSTOP: alive to Ray, silent to the
router) on a real local Ray, with `router.worker_timeout_s` = 2 s:

- a hung decode worker, with a second one beside it: within the timeout it shows
  `unresponsive`, every stream that was decoding on it continues on the other one with exactly
  the tokens of an uninterrupted run; woken (SIGCONT) it is warmed up and serves again, and
  every page of every worker comes back (the requests it held were cancelled when it woke);
- the only prefill worker hung: health NOT_SERVING within the timeout, new requests refused
  with UNAVAILABLE, a request whose prefill was queued on it waits and completes once it is
  back (warmed up), identical to an uninterrupted run; health SERVING again.

Before the change a stopped worker stayed in placement for 30 s (unresponsive_after_s) and its
streams hung until it woke: nothing migrated."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdcluster.v1 import inference_pb2 as pb
from tests.helpers import collect, our_ray_processes, stub, wait_free, wait_until

S = pb.SamplingParams
TIMEOUT_S = 2.0
SLACK_S = 2.5  # refresh cadence and a shared 2-core machine
# long enough that streams are still decoding seconds after their first chunk
ENGINE = dict(num_pages=512, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=8, page_size=16)


@pytest.fixture(scope="module")
def cluster(tiny_model):
    from cluster.config import ClusterConfig
    from cluster.runtime import Cluster

    tiny_model("llama")
    cfg = ClusterConfig.embedded(model="tiny", port=0, engine=ENGINE, prefill=1, decode=2, policy="least-loaded")
    cfg.router.worker_timeout_s = TIMEOUT_S
    c = Cluster(cfg)
    c.start()
    yield c
    c.stop()
    assert not our_ray_processes()


def worker(st, wid):
    return next(w for w in st.workers if w.worker_id == wid)


def status(s):
    return s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)


def greedy(prompt, n):
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=S(max_tokens=n, temperature=0, ignore_eos=True))


def back_serving(s, wid):
    w = worker(status(s), wid)
    return w.state == "serving" and w.healthy


def test_hung_decode_worker_streams_migrate_then_it_serves_again(cluster):
    s = stub(cluster)
    prompts = [list(range(1 + i, 30 + i)) for i in range(4)]
    refs = [collect(s, greedy(p, 900))[0] for p in prompts]
    calls = [s.Generate(greedy(p, 900), timeout=120) for p in prompts]
    heads = [list(next(c).token_ids) + list(next(c).token_ids) for c in calls]  # every stream is decoding
    st = status(s)
    victim = max(("decode-0", "decode-1"), key=lambda w: worker(st, w).running_requests)
    assert worker(st, victim).running_requests >= 1, st
    pid = worker(st, victim).pid
    stopped = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        done_at = {}

        def finish(i):
            msgs = list(calls[i])
            done_at[i] = time.monotonic()
            return heads[i] + [t for m in msgs for t in m.token_ids], msgs[-1]

        with ThreadPoolExecutor(len(calls)) as pool:
            seen = wait_until(lambda: worker(status(s), victim).state == "unresponsive" and time.monotonic(),
                              TIMEOUT_S + 10, 0.05, f"{victim} unresponsive")
            results = list(pool.map(finish, range(len(calls))))
        detect_s = seen - stopped
        print(f"\n{victim} SIGSTOP -> unresponsive in {detect_s:.2f} s (worker_timeout_s={TIMEOUT_S:g})")
        assert detect_s <= TIMEOUT_S + SLACK_S
        w = worker(status(s), victim)
        assert not w.healthy and "no load answer and no output" in w.last_error, w
        migrated = [last for _, last in results if last.placement.migrations == 1]
        assert migrated, "no stream was decoding on the stopped worker"
        for (ids, last), ref in zip(results, refs):
            assert ids == ref, "a migrated stream lost, repeated or changed tokens"
            assert last.placement.decode_worker != victim
        # the streams on the stopped worker did not wait for it to wake
        assert max(done_at.values()) - stopped < 60
    finally:
        os.kill(pid, signal.SIGCONT)
    woke = time.monotonic()
    wait_until(lambda: back_serving(s, victim), 30, 0.05, f"{victim} warmed up and serving again")
    print(f"{victim} SIGCONT -> serving in {time.monotonic() - woke:.2f} s")
    w = worker(status(s), victim)
    assert w.pid == pid and w.restarts == 0 and "unresponsive for" in w.last_error, w
    st = wait_free(s)  # the requests it held when it stopped were cancelled when it woke: no leak
    assert all(x.free_pages == x.total_pages and x.running_requests == 0 for x in st.workers), st
    req = pb.GenerateRequest(prompt_token_ids=prompts[0], decode_worker=victim,
                             sampling=S(max_tokens=20, temperature=0, ignore_eos=True))
    ids, _, last = collect(s, req)
    assert ids == refs[0][:20] and last.placement.decode_worker == victim


def test_hung_only_prefill_worker_health_not_serving_then_back(cluster):
    s = stub(cluster)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(cluster.router_address))

    def serving_status():
        return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

    assert serving_status() == health_pb2.HealthCheckResponse.SERVING
    prompt = list(range(7, 90))
    ref = collect(s, greedy(prompt, 16))[0]
    pid = worker(status(s), "prefill-0").pid
    stopped = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        # placed on it before the router knows: it waits, moved when the worker is given up on
        pending: list = []
        t = threading.Thread(target=lambda: pending.append(collect(s, greedy(prompt, 16))))
        t.start()
        wait_until(lambda: serving_status() == health_pb2.HealthCheckResponse.NOT_SERVING, TIMEOUT_S + 10, 0.05,
                   "health NOT_SERVING")
        detect_s = time.monotonic() - stopped
        print(f"\nprefill-0 SIGSTOP -> health NOT_SERVING in {detect_s:.2f} s (worker_timeout_s={TIMEOUT_S:g})")
        assert detect_s <= TIMEOUT_S + SLACK_S
        assert worker(status(s), "prefill-0").state == "unresponsive"
        with pytest.raises(grpc.RpcError) as err:  # new requests: refused, saying why
            collect(s, greedy(prompt, 4), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy prefill worker" in err.value.details()
        assert t.is_alive() and not pending  # the queued one waits for a prefill worker
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: serving_status() == health_pb2.HealthCheckResponse.SERVING, 30, 0.05, "health SERVING")
    t.join(60)
    assert pending and pending[0][0] == ref, "the request queued on the hung prefill worker"
    assert back_serving(s, "prefill-0")
    assert collect(s, greedy(prompt, 16))[0] == ref
    st = wait_free(s)
    assert all(x.free_pages == x.total_pages for x in st.workers), st
