"""Run inside a namespace (the test process cannot reach the namespaced hosts): talks to the
router and prints one JSON line.

    _client.py ADDRESS status
    _client.py ADDRESS generate '[[1, 2, 3], [4, 5]]' MAX_TOKENS
"""
from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc


def main() -> None:
    address, cmd = sys.argv[1], sys.argv[2]
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        if cmd == "status":
            st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=30)
            print(json.dumps([dict(worker_id=w.worker_id, role=w.role, node=w.node, pid=w.pid, healthy=w.healthy,
                                   state=w.state, restarts=w.restarts, free_pages=w.free_pages,
                                   total_pages=w.total_pages, tp_size=w.tp_size, rank_pids=list(w.rank_pids),
                                   rank_nodes=list(w.rank_nodes), num_threads=w.num_threads)
                              for w in st.workers]))
            return
        prompts, max_tokens = json.loads(sys.argv[3]), int(sys.argv[4])
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        if cmd == "stream":
            return streams(stub, prompts, sampling)

        def one(p):
            chunks = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=sampling), timeout=300))
            return [t for c in chunks for t in c.token_ids]

        with ThreadPoolExecutor(len(prompts)) as pool:
            print(json.dumps(list(pool.map(one, prompts))))


def streams(stub, prompts, sampling) -> None:
    """Concurrent streams: prints STARTED once every stream has its first token (the caller
    may then break things), then one JSON line: per stream its ids, migrations, decode worker
    and the longest gap between two chunks (seconds)."""
    started = threading.Barrier(len(prompts) + 1)

    def one(p):
        ids, gap, last, final, first = [], 0.0, None, None, True
        for c in stub.Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=sampling), timeout=600):
            now = time.monotonic()
            if last is not None:
                gap = max(gap, now - last)
            last = now
            ids += c.token_ids
            final = c
            if first and c.token_ids:
                first = False
                started.wait()
        return dict(ids=ids, migrations=final.placement.migrations, decode_worker=final.placement.decode_worker,
                    max_gap_s=gap)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(one, p) for p in prompts]
        started.wait()
        print("STARTED", flush=True)
        print(json.dumps([f.result() for f in futs]), flush=True)


if __name__ == "__main__":
    main()
