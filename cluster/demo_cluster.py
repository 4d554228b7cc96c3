"""`pdcluster demo-cluster` (what `make demo` runs): `serve` on the embedded default (one
prefill + one decode worker on a local loopback Ray, the built-in `small` model), a handful
of concurrent Generate streams printed as their tokens arrive with TTFT and ITL, then a
clean shutdown. The weights are random, so the text is gibberish: the machinery is the point."""
from __future__ import annotations

import argparse
import threading
import time

PROMPTS = ("The prefill pool builds the KV cache,", "Disaggregated serving moves pages so that",
           "Tokens per second on the decode pool depend on", "A request's way through the router is")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small")
    parser.add_argument("--kv-transport", choices=("nixl", "grpc"), default="nixl")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=4)


def run(args: argparse.Namespace) -> int:
    import grpc

    from cluster.config import ClusterConfig
    from cluster.runtime import Cluster
    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    cfg = ClusterConfig.embedded(model=args.model, transport=args.kv_transport, port=0)
    t0 = time.perf_counter()
    cluster = Cluster(cfg)
    print(f"starting a local cluster: {args.model}, 1 prefill + 1 decode worker, KV over {args.kv_transport}", flush=True)
    try:
        addr = cluster.start()
        print(f"SERVING on {addr} after {time.perf_counter() - t0:.1f}s\n", flush=True)
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(addr))
        lock, results = threading.Lock(), {}

        def one(i: int) -> None:
            prompt = PROMPTS[i % len(PROMPTS)]
            req = pb.GenerateRequest(request_id=f"demo-{i}", prompt=prompt,
                                     sampling=pb.SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
            start, times, last = time.perf_counter(), [], None
            for chunk in stub.Generate(req, timeout=300):
                if chunk.token_ids:
                    times.append(time.perf_counter())
                    with lock:
                        print(f"[demo-{i}] +{len(chunk.token_ids)} token(s) {chunk.text!r}", flush=True)
                last = chunk
            gaps = [b - a for a, b in zip(times, times[1:])]
            results[i] = (prompt, times[0] - start, sum(gaps) / len(gaps) if gaps else float("nan"), last)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.streams)]
        wall = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - wall
        print()
        total = 0
        for i in sorted(results):
            prompt, ttft, itl, last = results[i]
            total += last.usage.completion_tokens
            print(f"[demo-{i}] {prompt!r}: {last.usage.completion_tokens} tokens, finish={last.finish_reason}, "
                  f"TTFT {ttft * 1e3:.0f} ms (prefill {last.timings.prefill_s * 1e3:.0f} ms, transfer "
                  f"{last.timings.transfer_s * 1e3:.0f} ms), ITL {itl * 1e3:.1f} ms, prefill on "
                  f"{last.placement.prefill_worker}, decode on {last.placement.decode_worker}")
        st = stub.ClusterStatus(pb.ClusterStatusRequest())
        kv = ", ".join(f"{w.worker_id} {w.free_pages}/{w.total_pages} pages free" for w in st.workers)
        print(f"\n{len(results)} streams, {total} tokens in {wall:.2f}s ({total / wall:.1f} tokens/s); {kv}")
    finally:
        print("shutting down...", flush=True)
        cluster.stop()
    print("stopped")
    return 0
