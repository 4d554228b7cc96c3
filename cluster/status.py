"""`pdcluster status`: pools, workers, load and KV usage of a running cluster."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="127.0.0.1:50051", help="router HOST:PORT")
    from proto.client import add_client_arguments

    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import grpc

    from proto.client import client_auth
    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    with client_auth(args).channel(args.address) as ch:
        try:
            st = pb_grpc.InferenceStub(ch).ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            print(f"pdcluster status: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(f"router {args.address}: policy {st.policy}, {st.inflight_requests}/{st.max_inflight} in flight, "
          f"{st.queued_requests}/{st.max_queue} queued, {st.requests_served} served, {st.requests_failed} failed")
    for p in st.pools:  # each pool's target (Scale) and serving workers now
        print(f"pool {p.name} ({p.role}): {p.current_replicas}/{p.target_replicas} serving (max {p.max_replicas})"
              + (f"; {p.start_failures} failed start(s): {_one_line(p.error)}" if p.error else ""))
    print(f"{'worker':<16}{'role':<10}{'state':<10}{'ok':<4}{'pid':>8}  {'node':<16}{'tp':>3}{'threads':>8}"
          f"{'restarts':>9}{'KV used':>15}"
          f"{'running':>8}{'waiting':>8}{'queued tok':>11}{'tok/s':>8}{'prefix hit':>11}{'placed':>7}")
    notes, ranks = [], []
    for w in st.workers:
        used = w.total_pages - w.free_pages
        kv = f"{used}/{w.total_pages} ({used / w.total_pages:.0%})" if w.total_pages else "-"
        print(f"{w.worker_id:<16}{w.role:<10}{w.state or '-':<10}{'yes' if w.healthy else 'NO':<4}{w.pid or '-':>8}  "
              f"{w.node or '-':<16}{w.tp_size or '-':>3}{w.num_threads or '-':>8}{w.restarts:>9}{kv:>15}"
              f"{w.running_requests:>8}{w.waiting_requests:>8}"
              f"{w.queued_tokens:>11}{w.tokens_per_s:>8.1f}{w.prefix_cache_hit_rate:>11.0%}{w.requests_placed:>7}")
        if w.moving_to:
            notes.append(f"  {w.worker_id}: moving to pool {w.moving_to} ({w.state})")
        if w.error or w.last_error:
            notes.append(f"  {w.worker_id}: {_one_line(w.error or w.last_error)}"
                         + (" (now serving)" if w.healthy and not w.error else ""))
        if w.tp_size > 1:
            ranks.append(f"  {w.worker_id}: " + ", ".join(
                f"rank {r} pid {pid} on {node or '-'}" for r, (pid, node) in enumerate(zip(w.rank_pids, w.rank_nodes))))
    for k in st.kv_stores:  # the nodes' KV stores (docs/kv-cache.md)
        used = k.total_pages - k.free_pages
        print(f"KV store {k.store_id} on {k.node or '-'}: {'ok' if k.healthy else 'DOWN'}, pid {k.pid or '-'}, "
              f"{k.total_pages} pages ({used} leased or pinned), hit rate {k.hit_rate:.0%}, index {k.kv_index_state} "
              f"({k.kv_index_blocks} blocks)" + (f": {_one_line(k.error)}" if k.error else ""))
    if st.kv_stores or st.kv_fetched_tokens:
        print(f"KV tokens fetched instead of computed: {st.kv_fetched_tokens}; copied into the stores: "
              f"{st.kv_offloaded_tokens}")
    if ranks:  # a tensor-parallel worker's ranks: losing any loses the worker
        print("\n".join(["tensor-parallel ranks:", *ranks]))
    if notes:  # reasons below the table, one line each: a remote traceback never breaks it
        print("\n".join(["why:", *notes]))
    return 0


def _one_line(text: str, width: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."
