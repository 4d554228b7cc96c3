"""The workload flags `bench serve` and `plan simulate` share, and the Workload they build,
so a simulated run and a measured one read the same requests from the same command line."""
from __future__ import annotations

import argparse
import math
import os

from loadgen.workloads import DATASETS, FORMATS, KINDS, Workload, build_workload, format_of


def parse_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX integers, got {text!r}") from None
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo_i, hi_i


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="random",
                   help=f"a trace: {', '.join(DATASETS)} (looked up in $PDCLUSTER_DATA/traces), a trace file's path "
                        f"(.csv: Azure, .jsonl: Mooncake), or random (default)")
    p.add_argument("--dataset-path", help="trace file of --dataset-format (overrides --dataset)")
    p.add_argument("--dataset-format", choices=FORMATS, help="format of --dataset-path, or of a --dataset PATH whose "
                                                             "name does not tell")
    p.add_argument("--num-requests", type=int, default=None, help=">= 1; default: whole trace, 100 for random")
    p.add_argument("--time-scale", type=float, default=1.0, help="> 0; multiplies trace arrival offsets")
    p.add_argument("--length-scale", type=float, default=None,
                   help="> 0; multiplies prompt/output lengths; default: fit the model's max_model_len")
    p.add_argument("--request-rate", type=float, default=None, help="> 0 req/s; replaces trace times; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="> 0; gamma shape of inter-arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help=">= 1 requests in flight at most")
    p.add_argument("--random-input-len", type=parse_range, default=(32, 128), metavar="MIN:MAX")
    p.add_argument("--random-output-len", type=parse_range, default=(16, 64), metavar="MIN:MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="50,90,99", help="comma list in 0..100")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs, KEY in ttft tpot itl e2e")


def validate_workload_arguments(args: argparse.Namespace) -> tuple[tuple[float, ...], dict[str, float]]:
    """Raises ValueError naming the flag and its allowed range; returns (percentiles, SLOs)."""
    from loadgen.metrics import parse_slo

    checks = [("--num-requests", args.num_requests, lambda v: v >= 1, ">= 1"),
              ("--time-scale", args.time_scale, lambda v: v > 0 and math.isfinite(v), "> 0"),
              ("--length-scale", args.length_scale, lambda v: v > 0 and math.isfinite(v), "> 0"),
              ("--request-rate", args.request_rate, lambda v: v > 0, "> 0 (or inf)"),
              ("--burstiness", args.burstiness, lambda v: v > 0 and math.isfinite(v), "> 0"),
              ("--max-concurrency", args.max_concurrency, lambda v: v >= 1, ">= 1")]
    for flag, value, ok, allowed in checks:
        if value is not None and not ok(value):
            raise ValueError(f"{flag} must be {allowed}, got {value}")
    if args.dataset_path and not args.dataset_format:
        raise ValueError("--dataset-path needs --dataset-format (azure or mooncake)")
    if args.dataset_format and not (args.dataset_path or args.dataset not in KINDS):
        raise ValueError("--dataset-format needs --dataset-path or --dataset PATH")
    if not args.dataset_path and args.dataset not in KINDS and not os.path.isfile(args.dataset):
        raise ValueError(f"--dataset must be one of {', '.join(KINDS)} or a trace file's path, got {args.dataset!r}")
    try:
        pcts = tuple(float(x) for x in args.percentiles.split(","))
    except ValueError:
        raise ValueError(f"--percentiles must be a comma list of numbers in 0..100, got {args.percentiles!r}") from None
    if not pcts or not all(0 <= q <= 100 for q in pcts):
        raise ValueError(f"--percentiles must be in 0..100, got {args.percentiles!r}")
    return pcts, parse_slo(args.goodput)


def workload_from_args(args: argparse.Namespace, max_model_len: int | None) -> Workload:
    kind, path = args.dataset, args.dataset_path
    if path:
        kind = args.dataset_format
    elif kind not in KINDS:  # --dataset PATH
        kind, path = args.dataset_format or format_of(kind), kind
    return build_workload(kind, path=path, num_requests=args.num_requests, time_scale=args.time_scale,
                          length_scale=args.length_scale, max_model_len=max_model_len,
                          request_rate=args.request_rate, burstiness=args.burstiness, seed=args.seed,
                          input_range=args.random_input_len, output_range=args.random_output_len)
