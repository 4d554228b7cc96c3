"""`pdcluster plan validate`: profile (or load a profile), simulate each case, run it on the real
cluster here, and print predicted against measured figures with the relative error."""
from __future__ import annotations

import argparse
import os
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from planning.validate import CASES

    p.add_argument("--model", default="bench", help="built-in preset or checkpoint folder (default bench)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--profile", help="a profile JSON of this model and dtype on this machine; default: profile now")
    p.add_argument("--profile-out", default="validate-profile.json", help="where a fresh profile is written")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--num-requests", type=int, help=">= 1: override every case's request count")
    p.add_argument("--dataset", help="override every case's workload (a bench serve --dataset name, or random)")
    p.add_argument("--transport", default="nixl", choices=("nixl", "grpc"))
    p.add_argument("--repeats", type=int, default=1,
                   help=">= 1 runs of each case (fresh cluster each): errors of the means, and the runs' spread")
    p.add_argument("--predict-only", action="store_true", help="simulate the cases, run nothing real")
    p.add_argument("--no-calibrate", action="store_true",
                   help="predict from the profile as it is (no calibration on each case's cluster)")
    p.add_argument("--bracket", action="store_true",
                   help="calibrate before and after each replay and fit on both (the machine's drift during "
                        "a case then lands on both sides)")
    p.add_argument("--no-load", action="store_true",
                   help="skip the synthetic load run that fits the slow-down of streams decoding alongside "
                        "others (load_run.fit_load)")
    p.add_argument("--load-per-run", action="store_true",
                   help="predict each repeat with its own load run's fit (default: one fit pooled over the "
                        "case's repeats)")
    p.add_argument("--no-dispersion", action="store_true",
                   help="compare the simulator's own TTFT/TPOT figures (default: their expectation over the "
                        "per-request spread the load runs showed beyond the model, planning/dispersion.py)")
    p.add_argument("--load-requests", type=int,
                   help=">= 4 requests in the load run (default: the case's rate x 60 s, at least 24)")
    p.add_argument("--json", default="validate.json", help="every figure, both sides, per case")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from planning.latency import LatencyModel
    from planning.validate import CASES, TARGET, predict, validate

    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if not names or unknown:
        print(f"pdcluster plan validate: --cases must name some of {', '.join(CASES)}, got {args.cases!r}",
              file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"pdcluster plan validate: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    if args.num_requests is not None and args.num_requests < 1:
        print(f"pdcluster plan validate: --num-requests must be >= 1, got {args.num_requests}", file=sys.stderr)
        return 2
    if args.load_requests is not None and args.load_requests < 4:
        print(f"pdcluster plan validate: --load-requests must be >= 4, got {args.load_requests}", file=sys.stderr)
        return 2
    from loadgen.workloads import KINDS

    if args.dataset is not None and args.dataset not in KINDS and not os.path.isfile(args.dataset):
        print(f"pdcluster plan validate: --dataset must be one of {', '.join(KINDS)} or a trace file's path, "
              f"got {args.dataset!r}",
              file=sys.stderr)
        return 2
    cases = [replace(CASES[n], num_requests=args.num_requests or CASES[n].num_requests,
                     dataset=args.dataset or CASES[n].dataset) for n in names]
    if args.profile:
        lm = LatencyModel.load(args.profile)
    else:
        from planning.profile import profile_engine

        res = profile_engine(args.model, args.dtype, transports=(args.transport,))
        Path(args.profile_out).write_text(json.dumps(res, indent=2))
        print(f"profiled {args.model} ({args.dtype}) -> {args.profile_out}")
        lm = LatencyModel.from_json(res["latency_model"])
    max_len = int(lm.meta.get("max_model_len") or 2048)
    if args.predict_only:
        for c in cases:
            s = predict(c, lm, args.model, args.dtype, args.transport, max_len)["summary"]
            print(f"{c.name}: TTFT p50 {s['ttft_ms']['median']:.0f} ms p90 {s['ttft_ms']['p90']:.0f} ms, "
                  f"TPOT p50 {s['tpot_ms']['median']:.1f} ms p90 {s['tpot_ms']['p90']:.1f} ms, "
                  f"{s['request_throughput']:.3f} req/s")
        return 0
    results = validate(cases, lm, model=args.model, dtype=args.dtype, transport=args.transport, max_model_len=max_len,
                       calibrate=not args.no_calibrate, repeats=args.repeats, bracket=args.bracket,
                       load=not args.no_load, load_requests=args.load_requests,
                       pool_load=not args.load_per_run, disperse=not args.no_dispersion)
    worst = max((abs(r["rel_err"]) for res in results for r in res["rows"] if r["rel_err"] is not None), default=0.0)
    print(f"largest error {worst:.1%} (target <= {TARGET:.0%}): {'met' if worst <= TARGET else 'missed'}")
    Path(args.json).write_text(json.dumps({"profile": lm.to_json(), "results": results, "largest_error": worst},
                                          indent=1, default=str))
    print(f"wrote {args.json}")
    return 0
