"""`pdcluster drain`: take a running router out of service without stopping it. Health says
NOT_SERVING at once and new requests are refused with UNAVAILABLE "draining" (a load balancer
moves traffic elsewhere); running requests finish within --grace, then are cancelled. The
command returns once the router is idle; stop the process afterwards (SIGTERM)."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="127.0.0.1:50051", help="router HOST:PORT")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds running requests get to finish before they are cancelled (default 30)")
    from proto.client import add_client_arguments

    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import grpc

    from proto.client import client_auth
    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    if not 0 < args.grace <= 3600:
        print(f"pdcluster drain: --grace must be in (0, 3600], got {args.grace}", file=sys.stderr)
        return 2
    with client_auth(args).channel(args.address) as ch:
        try:
            resp = pb_grpc.InferenceStub(ch).Drain(pb.DrainRequest(grace_s=args.grace), timeout=args.grace + 30)
        except grpc.RpcError as exc:
            print(f"pdcluster drain: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(f"router {args.address} drained: {resp.finished} requests finished, {resp.cancelled} cancelled "
          f"after the {args.grace:g} s grace; it refuses new requests until it is restarted")
    return 0
