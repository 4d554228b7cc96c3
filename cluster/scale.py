"""`pdcluster scale`: set a pool's target of serving workers on a running cluster. The router
records the target; the cluster starts and warms up workers (scale-out) or drains and stops the
least loaded ones (scale-in: their streams finish or move with identical tokens). With --wait
the command returns once the pool has its target and no worker of it is starting, warming or
draining."""
from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="127.0.0.1:50051", help="router HOST:PORT")
    parser.add_argument("--pool", required=True, help="the pool to resize (a pool name of the cluster's config)")
    parser.add_argument("--replicas", type=int, required=True, help="the pool's new number of serving workers")
    parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="wait up to this long for the pool to reach its target (0: return at once)")
    from proto.client import add_client_arguments

    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import grpc

    from proto.client import client_auth
    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    with client_auth(args).channel(args.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        try:
            resp = stub.Scale(pb.ScaleRequest(pool=args.pool, replicas=args.replicas), timeout=10)
        except grpc.RpcError as exc:
            print(f"pdcluster scale: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
        print(f"pool {resp.pool}: target {resp.previous_target} -> {resp.target} replicas ({resp.current} serving now)")
        if args.wait <= 0:
            return 0
        deadline = time.monotonic() + args.wait
        said = ""
        while True:
            try:
                st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
            except grpc.RpcError as exc:
                print(f"pdcluster scale: status: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
            done, line = settled(st, args.pool)
            if line != said:
                print(line)
                said = line
            if done:
                return 0
            if time.monotonic() > deadline:
                print(f"pdcluster scale: pool {args.pool} did not reach its target within {args.wait:g} s",
                      file=sys.stderr)
                return 1
            time.sleep(0.5)


def settled(st, pool: str) -> tuple[bool, str]:
    """(whether `pool` has its target and nothing of it is in transition, a line saying where it is)."""
    p = next((p for p in st.pools if p.name == pool), None)
    if p is None:
        return False, f"pool {pool}: not in the router's status"
    moving = [f"{w.worker_id} {w.state}" for w in st.workers
              if w.pool == pool and w.state in ("starting", "warming", "draining")]
    line = (f"pool {pool}: {p.current_replicas}/{p.target_replicas} serving"
            + (f"; {', '.join(moving)}" if moving else "") + (f"; {p.error}" if p.error else ""))
    return p.current_replicas == p.target_replicas and not moving, line
