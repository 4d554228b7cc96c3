"""`pdcluster scale`: set a pool's target of serving workers on a running cluster, or move
workers from one pool to another. The router records the request; the cluster starts and warms
up workers (scale-out) or drains and stops the least loaded ones (scale-in: their streams
finish or move with identical tokens). A move (`--move N --from A --to B`) drains the least
loaded workers of A the same way, switches each one's role in its running process (its weights
stay loaded) and warms it up as a worker of B. With --wait the command returns once the pool
(both pools of a move) has its target and no worker of it is in transition."""
from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="127.0.0.1:50051", help="router HOST:PORT")
    parser.add_argument("--pool", help="the pool to resize (a pool name of the cluster's config)")
    parser.add_argument("--replicas", type=int, help="the pool's new number of serving workers")
    parser.add_argument("--move", type=int, metavar="N", help="move N serving workers from --from to --to (their "
                        "processes and weights kept; the pools must build engines alike on the same resources)")
    parser.add_argument("--from", dest="from_pool", metavar="POOL", help="the pool a move takes workers from")
    parser.add_argument("--to", dest="to_pool", metavar="POOL", help="the pool a move gives them to")
    parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="wait up to this long for the pool to reach its target (0: return at once)")
    from proto.client import add_client_arguments

    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import grpc

    from proto.client import client_auth
    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    if args.move is not None:
        if args.from_pool is None or args.to_pool is None or args.pool is not None or args.replicas is not None:
            print("pdcluster scale: --move N takes --from POOL and --to POOL (and neither --pool nor --replicas)",
                  file=sys.stderr)
            return 2
        if args.move < 1:
            print(f"pdcluster scale: --move must be >= 1, got {args.move}", file=sys.stderr)
            return 2
        request = pb.ScaleRequest(pool=args.from_pool, move=args.move, to_pool=args.to_pool)
        pools = [args.from_pool, args.to_pool]
    else:
        if args.pool is None or args.replicas is None or args.from_pool or args.to_pool:
            print("pdcluster scale: give --pool POOL --replicas N, or --move N --from POOL --to POOL", file=sys.stderr)
            return 2
        request = pb.ScaleRequest(pool=args.pool, replicas=args.replicas)
        pools = [args.pool]
    with client_auth(args).channel(args.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        try:
            resp = stub.Scale(request, timeout=10)
        except grpc.RpcError as exc:
            print(f"pdcluster scale: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
        if resp.to_pool:
            print(f"moving {args.move} worker(s): pool {resp.pool} target {resp.previous_target} -> {resp.target}, "
                  f"pool {resp.to_pool} target {resp.to_previous_target} -> {resp.to_target}")
        else:
            print(f"pool {resp.pool}: target {resp.previous_target} -> {resp.target} replicas "
                  f"({resp.current} serving now)")
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
            where = [settled(st, p) for p in pools]
            line = "; ".join(w[1] for w in where)
            if line != said:
                print(line)
                said = line
            if all(w[0] for w in where):
                return 0
            if time.monotonic() > deadline:
                print(f"pdcluster scale: pool(s) {', '.join(pools)} did not reach their target within {args.wait:g} s",
                      file=sys.stderr)
                return 1
            time.sleep(0.5)


def settled(st, pool: str) -> tuple[bool, str]:
    """(whether `pool` has its target and nothing of it is in transition, a line saying where it is)."""
    p = next((p for p in st.pools if p.name == pool), None)
    if p is None:
        return False, f"pool {pool}: not in the router's status"
    moving = [f"{w.worker_id} {w.state}" + (f" (moving to {w.moving_to})" if w.moving_to else "") for w in st.workers
              if (w.pool == pool or w.moving_to == pool) and w.state in ("starting", "warming", "draining", "switching")]
    line = (f"pool {pool}: {p.current_replicas}/{p.target_replicas} serving"
            + (f"; {', '.join(moving)}" if moving else "") + (f"; {p.error}" if p.error else ""))
    return p.current_replicas == p.target_replicas and not moving, line
