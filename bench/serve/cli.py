"""`pdcluster bench serve`: load a running endpoint with a trace or random workload and print
TTFT, TPOT, ITL, E2E, throughput and goodput (definitions in bench.serve.metrics)."""
from __future__ import annotations

import argparse
import math
import sys

from bench.serve.workloads import DATASETS, FORMATS


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX integers, got {text!r}") from None
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo_i, hi_i


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="router gRPC address host:port")
    p.add_argument("--dataset", choices=[*DATASETS, "random"], default="random")
    p.add_argument("--dataset-path", help="trace file of --dataset-format (overrides --dataset)")
    p.add_argument("--dataset-format", choices=FORMATS, help="format of --dataset-path")
    p.add_argument("--num-requests", type=int, default=None, help=">= 1; default: whole trace, 100 for random")
    p.add_argument("--time-scale", type=float, default=1.0, help="> 0; multiplies trace arrival offsets")
    p.add_argument("--length-scale", type=float, default=None,
                   help="> 0; multiplies prompt/output lengths; default: fit the model's max_model_len")
    p.add_argument("--request-rate", type=float, default=None, help="> 0 req/s; replaces trace times; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="> 0; gamma shape of inter-arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help=">= 1 requests in flight at most")
    p.add_argument("--random-input-len", type=_range, default=(32, 128), metavar="MIN:MAX")
    p.add_argument("--random-output-len", type=_range, default=(16, 64), metavar="MIN:MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="50,90,99", help="comma list in 0..100")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs, KEY in ttft tpot itl e2e")
    p.add_argument("--timeout", type=float, default=600.0, help="> 0 s per request")
    p.add_argument("--json", help="write every figure and per-request records here")
    p.add_argument("--plot", help="write PNG plots into this directory")
    p.add_argument("--no-progress", action="store_true")


def _validate(args: argparse.Namespace) -> tuple[tuple[float, ...], dict[str, float]]:
    from bench.serve.metrics import parse_slo

    checks = [("--num-requests", args.num_requests, lambda v: v >= 1, ">= 1"),
              ("--time-scale", args.time_scale, lambda v: v > 0 and math.isfinite(v), "> 0"),
              ("--length-scale", args.length_scale, lambda v: v > 0 and math.isfinite(v), "> 0"),
              ("--request-rate", args.request_rate, lambda v: v > 0, "> 0 (or inf)"),
              ("--burstiness", args.burstiness, lambda v: v > 0 and math.isfinite(v), "> 0"),
              ("--max-concurrency", args.max_concurrency, lambda v: v >= 1, ">= 1"),
              ("--timeout", args.timeout, lambda v: v > 0, "> 0")]
    for flag, value, ok, allowed in checks:
        if value is not None and not ok(value):
            raise ValueError(f"{flag} must be {allowed}, got {value}")
    if args.dataset_path and not args.dataset_format:
        raise ValueError("--dataset-path needs --dataset-format (azure or mooncake)")
    if args.dataset_format and not args.dataset_path:
        raise ValueError("--dataset-format needs --dataset-path")
    try:
        pcts = tuple(float(x) for x in args.percentiles.split(","))
    except ValueError:
        raise ValueError(f"--percentiles must be a comma list of numbers in 0..100, got {args.percentiles!r}") from None
    if not pcts or not all(0 <= q <= 100 for q in pcts):
        raise ValueError(f"--percentiles must be in 0..100, got {args.percentiles!r}")
    return pcts, parse_slo(args.goodput)


def run(args: argparse.Namespace) -> int:
    try:
        percentiles, slo = _validate(args)
    except ValueError as exc:
        print(f"pdcluster bench serve: {exc}", file=sys.stderr)
        return 2
    import asyncio

    import grpc

    from bench.serve import client, report
    from bench.serve.metrics import summarize
    from bench.serve.workloads import build_workload, materialize_prompts

    try:
        info = asyncio.run(client.model_info(args.address))
    except grpc.RpcError as exc:
        print(f"pdcluster bench serve: cannot reach {args.address}: {exc.code().name}", file=sys.stderr)
        return 1
    kind = args.dataset_format if args.dataset_path else args.dataset
    try:
        wl = build_workload(kind, path=args.dataset_path, num_requests=args.num_requests, time_scale=args.time_scale,
                            length_scale=args.length_scale, max_model_len=info.max_model_len,
                            request_rate=args.request_rate, burstiness=args.burstiness, seed=args.seed,
                            input_range=args.random_input_len, output_range=args.random_output_len)
    except (ValueError, OSError) as exc:
        print(f"pdcluster bench serve: {exc}", file=sys.stderr)
        return 2
    materialize_prompts(wl, info.vocab_size, args.seed)
    records, duration, timeline = client.run_benchmark_sync(args.address, wl, max_concurrency=args.max_concurrency,
                                                            progress=not args.no_progress, timeout_s=args.timeout)
    summary = summarize(records, duration, percentiles, slo or None)
    print(report.format_table(summary))
    if args.json:
        config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        config.update(model_id=info.model_id, workload=wl.name, workload_meta=wl.meta, block_tokens=wl.block_tokens)
        report.write_json(args.json, summary, records, config)
    if args.plot:
        report.write_plots(args.plot, records, timeline)
    return 0
