"""`pdcluster status`: pools, workers, load and KV usage of a running cluster."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="127.0.0.1:50051", help="router HOST:PORT")


def run(args: argparse.Namespace) -> int:
    import grpc

    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(args.address) as ch:
        try:
            st = pb_grpc.InferenceStub(ch).ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            print(f"pdcluster status: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(f"router {args.address}: policy {st.policy}, {st.inflight_requests}/{st.max_inflight} in flight, "
          f"{st.queued_requests}/{st.max_queue} queued, {st.requests_served} served, {st.requests_failed} failed")
    print(f"{'worker':<16}{'pool':<12}{'role':<10}{'ok':<4}{'KV used':>14}{'running':>9}{'waiting':>9}"
          f"{'queued tok':>11}{'tok/s':>8}{'prefix hit':>11}{'placed':>8}")
    for w in st.workers:
        used = w.total_pages - w.free_pages
        kv = f"{used}/{w.total_pages} ({used / w.total_pages:.0%})" if w.total_pages else "-"
        print(f"{w.worker_id:<16}{w.pool:<12}{w.role:<10}{'yes' if w.healthy else 'NO':<4}{kv:>14}"
              f"{w.running_requests:>9}{w.waiting_requests:>9}{w.queued_tokens:>11}{w.tokens_per_s:>8.1f}"
              f"{w.prefix_cache_hit_rate:>11.0%}{w.requests_placed:>8}" + (f"  {w.error}" if w.error else ""))
    return 0
