"""Run inside a namespace (the test process cannot reach the namespaced hosts): talks to the
router and prints one JSON line.

    _client.py ADDRESS status
    _client.py ADDRESS generate '[[1, 2, 3], [4, 5]]' MAX_TOKENS
    _client.py ADDRESS stream '[[1, 2, 3], [4, 5]]' MAX_TOKENS
    _client.py ADDRESS scale POOL REPLICAS
    _client.py ADDRESS watch INTERVAL_S          # a JSON line per ClusterStatus, until killed
    _client.py ADDRESS load '[[1, 2, 3], [4, 5]]' '[MAX_TOKENS, MAX_TOKENS]' CONCURRENCY STOP_FILE
"""
from __future__ import annotations

import json
import os
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
            print(json.dumps([worker(w) for w in st.workers]))
            return
        if cmd == "stores":
            st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=30)
            print(json.dumps(dict(stores=[dict(store_id=k.store_id, node=k.node, healthy=k.healthy, pid=k.pid,
                                               total_pages=k.total_pages, kv_index_blocks=k.kv_index_blocks,
                                               kv_index_state=k.kv_index_state) for k in st.kv_stores],
                                  fetched=st.kv_fetched_tokens, offloaded=st.kv_offloaded_tokens)))
            return
        if cmd == "scale":
            t = time.time()
            r = stub.Scale(pb.ScaleRequest(pool=sys.argv[3], replicas=int(sys.argv[4])), timeout=30)
            print(json.dumps(dict(t=t, pool=r.pool, previous_target=r.previous_target, target=r.target,
                                  current=r.current)))
            return
        if cmd == "watch":
            return watch(stub, float(sys.argv[3]))
        if cmd == "load":
            return load(stub, json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
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


def worker(w) -> dict:
    return dict(worker_id=w.worker_id, pool=w.pool, role=w.role, node=w.node, pid=w.pid, healthy=w.healthy,
                state=w.state, restarts=w.restarts, free_pages=w.free_pages, total_pages=w.total_pages,
                running_requests=w.running_requests, waiting_requests=w.waiting_requests,
                requests_placed=w.requests_placed, tp_size=w.tp_size, rank_pids=list(w.rank_pids),
                rank_nodes=list(w.rank_nodes), num_threads=w.num_threads, error=w.error)


def watch(stub, interval_s: float) -> None:
    """ClusterStatus every interval_s, one JSON line each (with its time.time()), until killed;
    a failed call is a line with its error (the test decides what that means)."""
    while True:
        t = time.time()
        try:
            st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
            line = dict(t=t, workers=[worker(w) for w in st.workers],
                        pools=[dict(name=p.name, target=p.target_replicas, current=p.current_replicas,
                                    start_failures=p.start_failures, error=p.error) for p in st.pools],
                        requests_served=st.requests_served, requests_failed=st.requests_failed)
        except grpc.RpcError as exc:
            line = dict(t=t, rpc_error=f"{exc.code().name}: {exc.details()}")
        print(json.dumps(line), flush=True)
        time.sleep(interval_s)


def load(stub, prompts, max_tokens: list[int], concurrency: int, stop_file: str) -> None:
    """`concurrency` greedy streams open at every moment: each slot starts its next stream (the
    prompts taken in turn, each with its own max_tokens, so that streams end at different times)
    as soon as its last one ends, until `stop_file` exists; then the open ones finish. Prints
    STARTED once every slot has its first token, then one JSON line: per stream the prompt's
    index, its ids, the decode worker it ended on, its migrations and the error that ended it
    ("" for none)."""
    started = threading.Barrier(concurrency + 1)
    lock = threading.Lock()
    turn = [0]
    done: list[dict] = []

    def slot() -> None:
        first = True
        while not os.path.exists(stop_file):
            with lock:
                k, turn[0] = turn[0] % len(prompts), turn[0] + 1
            ids, final, error = [], None, ""
            try:
                sampling = pb.SamplingParams(max_tokens=max_tokens[k], temperature=0, ignore_eos=True)
                for c in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompts[k], sampling=sampling),
                                       timeout=600):
                    ids += c.token_ids
                    final = c
                    if first and c.token_ids:
                        first = False
                        try:
                            started.wait()
                        except threading.BrokenBarrierError:  # another slot failed first: go on
                            pass
            except grpc.RpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            with lock:
                done.append(dict(prompt=k, ids=ids, error=error,
                                 decode_worker=final.placement.decode_worker if final else "",
                                 migrations=final.placement.migrations if final else 0))
            if first:  # failed before its first token: do not hold the others at the barrier
                first = False
                started.abort()

    with ThreadPoolExecutor(concurrency) as pool:
        futs = [pool.submit(slot) for _ in range(concurrency)]
        try:
            started.wait()
            print("STARTED", flush=True)
        except threading.BrokenBarrierError:
            print("FAILED", flush=True)
        for f in futs:
            f.result()
    print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main()
