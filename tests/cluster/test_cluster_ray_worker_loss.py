"""A decode worker's process killed mid-stream (kill -9), on a real local Ray, with no other
decode worker: the client's open streams wait for its replacement and then complete, each
identical to an uninterrupted run (migration: engine.outputs.Resume); the router keeps
answering and says why the worker was out; the prefill worker's pages all come back; and Ray
restarts the worker in its placement group bundle: the router warms the new process up (its KV
transfer handshake done) and places on it again, without a restart of the cluster. A worker's outputs reach the router on one batched Ray stream per
router (`router.handles.WorkerHandle`), so the loss has to reach every request open on it."""
from __future__ import annotations

import os
import signal
import time

import grpc

from cluster.config import ClusterConfig
from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc
from tests.helpers import collect, wait_until

S = pb.SamplingParams
# long enough that a stream is still open seconds after its first chunk
ENGINE = dict(num_pages=512, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=8, page_size=16)


def test_a_killed_decode_worker_ends_its_streams_cleanly_and_is_replaced(tiny_model):
    from cluster.runtime import Cluster

    tiny_model("llama")
    cluster = Cluster(ClusterConfig.embedded(model="tiny", port=0, engine=ENGINE, prefill=1, decode=1,
                                             transport="nixl"))
    cluster.start()
    try:
        import ray  # only after Cluster.start: ray's first import decides whether it binds loopback only

        s = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.router_address))
        short = pb.GenerateRequest(prompt_token_ids=list(range(5, 25)), sampling=S(max_tokens=8, temperature=0,
                                                                                   ignore_eos=True))
        before, _, _ = collect(s, short)
        req = pb.GenerateRequest(prompt_token_ids=list(range(1, 40)),
                                 sampling=S(max_tokens=950, temperature=0, ignore_eos=True))
        reference, _, _ = collect(s, req)
        calls = [s.Generate(req, timeout=120) for _ in range(3)]
        heads = []
        for call in calls:
            heads.append(list(next(call).token_ids) + list(next(call).token_ids))  # the decode stream is open
        decode = next(w for w in cluster.workers if w.role == "decode")
        pid = ray.get(decode.actor.pid.remote(), timeout=30)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for call, head in zip(calls, heads):  # the calls' timeout is the hang guard
            msgs = list(call)
            ids = head + [t for m in msgs for t in m.token_ids]
            assert ids == reference, "the migrated stream lost, repeated or changed tokens"
            assert msgs[-1].placement.migrations == 1 and msgs[-1].usage.completion_tokens == len(reference)

        def worker(st, wid):
            return next(w for w in st.workers if w.worker_id == wid)

        def replaced():
            st = s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
            w = worker(st, decode.worker_id)
            return st if w.state == "serving" and w.healthy and w.restarts == 1 and w.pid not in (0, pid) else None

        st = wait_until(replaced, 60, 0.1, f"{decode.worker_id} replaced and back in placement")
        recovery_s = time.monotonic() - killed
        print(f"\n{decode.worker_id}: killed -> serving again in {recovery_s:.1f} s")
        w = worker(st, decode.worker_id)
        assert w.node == "127.0.0.1" and w.last_error and "\n" not in w.last_error, w  # why it was out, one line
        prefill = worker(st, "prefill-0")
        assert prefill.free_pages == prefill.total_pages and prefill.restarts == 0, prefill
        after, _, last = collect(s, short)
        assert after == before and last.placement.decode_worker == decode.worker_id

        # the prefill worker too: replaced, its KV handshakes with the decode worker done again
        prefill_actor = next(w.actor for w in cluster.workers if w.role == "prefill")
        prefill_pid = ray.get(prefill_actor.pid.remote(), timeout=30)
        os.kill(prefill_pid, signal.SIGKILL)

        def prefill_replaced():
            w = worker(s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10), "prefill-0")
            return w.state == "serving" and w.healthy and w.restarts == 1 and w.pid not in (0, prefill_pid)

        wait_until(prefill_replaced, 60, 0.1, "prefill-0 replaced and back in placement")
        again, _, last = collect(s, short)
        assert again == before and last.placement.prefill_worker == "prefill-0"
        st = s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        assert all(w.free_pages == w.total_pages for w in st.workers), st
    finally:
        cluster.stop()
