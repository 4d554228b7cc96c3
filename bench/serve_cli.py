"""`pdcluster bench serve`: load a running endpoint with a trace or random workload and print
TTFT, TPOT, ITL, E2E, throughput and goodput (definitions in loadgen.metrics)."""
from __future__ import annotations

import argparse
import sys

from loadgen.workload_args import add_workload_arguments, validate_workload_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="router gRPC address host:port")
    add_workload_arguments(p)
    p.add_argument("--timeout", type=float, default=600.0, help="> 0 s per request")
    p.add_argument("--json", help="write every figure and per-request records here")
    p.add_argument("--plot", help="write PNG plots into this directory")
    p.add_argument("--no-progress", action="store_true")
    from proto.client import add_client_arguments

    add_client_arguments(p)


def _validate(args: argparse.Namespace) -> tuple[tuple[float, ...], dict[str, float]]:
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    return validate_workload_arguments(args)


def run(args: argparse.Namespace) -> int:
    try:
        percentiles, slo = _validate(args)
    except ValueError as exc:
        print(f"pdcluster bench serve: {exc}", file=sys.stderr)
        return 2
    import asyncio

    import grpc

    from loadgen import client, report
    from proto.client import client_auth
    from loadgen.metrics import summarize
    from loadgen.workload_args import workload_from_args
    from loadgen.workloads import materialize_prompts

    auth = client_auth(args)
    try:
        info = asyncio.run(client.model_info(args.address, auth=auth))
    except grpc.RpcError as exc:
        print(f"pdcluster bench serve: cannot reach {args.address}: {exc.code().name}", file=sys.stderr)
        return 1
    try:
        wl = workload_from_args(args, info.max_model_len)
    except (ValueError, OSError) as exc:
        print(f"pdcluster bench serve: {exc}", file=sys.stderr)
        return 2
    materialize_prompts(wl, info.vocab_size, args.seed)
    records, duration, timeline = client.run_benchmark_sync(args.address, wl, max_concurrency=args.max_concurrency,
                                                            progress=not args.no_progress, timeout_s=args.timeout,
                                                            auth=auth)
    summary = summarize(records, duration, percentiles, slo or None)
    print(report.format_table(summary))
    if args.json:
        config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "api_key"}
        config.update(model_id=info.model_id, workload=wl.name, workload_meta=wl.meta, block_tokens=wl.block_tokens)
        report.write_json(args.json, summary, records, config)
    if args.plot:
        report.write_plots(args.plot, records, timeline)
    return 0
