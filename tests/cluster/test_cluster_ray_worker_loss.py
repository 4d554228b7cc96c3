"""A decode worker lost mid-stream, on a real local Ray: the client's open stream ends with
UNAVAILABLE naming the worker (not a hang, not an UNKNOWN error), the router keeps answering,
and the prefill worker's pages all come back. A worker's outputs reach the router on one
batched Ray stream per router (`router.handles.WorkerHandle`), so the loss has to reach every
request open on it."""
from __future__ import annotations

import grpc
import pytest

from cluster.config import ClusterConfig
from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc
from tests.helpers import wait_until

S = pb.SamplingParams
# long enough that a stream is still open seconds after its first chunk
ENGINE = dict(num_pages=512, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=8, page_size=16)


def test_decode_worker_lost_mid_stream_ends_open_streams_with_unavailable(tiny_model):
    from cluster.runtime import Cluster

    tiny_model("llama")
    cluster = Cluster(ClusterConfig.embedded(model="tiny", port=0, engine=ENGINE, prefill=1, decode=1,
                                             transport="nixl"))
    cluster.start()
    try:
        s = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.router_address))
        req = pb.GenerateRequest(prompt_token_ids=list(range(1, 40)),
                                 sampling=S(max_tokens=950, temperature=0, ignore_eos=True))
        calls = [s.Generate(req, timeout=120) for _ in range(3)]
        for call in calls:
            next(call)
            next(call)  # the second chunk comes from the decode worker: its stream is open
        import ray  # only after Cluster.start: ray's first import decides whether it binds loopback only

        decode = next(w for w in cluster.workers if w.role == "decode")
        ray.kill(decode.actor)
        for call in calls:  # each would otherwise run to its 120 s deadline: the calls' timeout is the hang guard
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert decode.worker_id in err.value.details()

        def prefill_pages_back():
            st = s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
            prefill = [w for w in st.workers if w.role == "prefill"]
            return prefill and all(w.free_pages == w.total_pages for w in prefill)

        # the router still answers, and the surviving prefill worker holds no pages
        wait_until(prefill_pages_back, 20, 0.1, "the prefill worker's pages all back")
    finally:
        cluster.stop()
