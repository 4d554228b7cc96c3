"""`pdcluster plan profile`: profile the real engine here, or cross-check the roofline on H100 data."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bench", help="built-in preset or checkpoint folder (default bench)")
    parser.add_argument("--out", default="profile.json", help="where to write the profile JSON")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--quick", action="store_true", help="small grid (for tests with the tiny preset)")
    parser.add_argument("--transports", default="nixl,grpc",
                        help="KV transports to time between two processes, comma list of nixl, grpc ('' = none)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (>= 1), as the pools run")
    parser.add_argument("--serving", action="store_true",
                        help="also time decode steps and the first token's delay through a real local cluster "
                             "(router, Ray, gRPC): what the simulator should predict for a served endpoint")
    parser.add_argument("--load-rate", type=float,
                        help="with --serving: also serve synthetic requests at this rate (req/s, > 0; about 60 s) "
                             "and fit what a staggered load costs beyond the controlled shapes (the rate the "
                             "workload you will simulate runs at)")
    parser.add_argument("--load-requests", type=int,
                        help=">= 4 requests in the load run (default: the rate x 60 s, at least 24)")
    parser.add_argument("--crosscheck-h100", action="store_true",
                        help="instead: roofline vs Vidur H100 Llama-2 7B/70B MLP profiles, print the errors")


def run(args: argparse.Namespace) -> int:
    if args.crosscheck_h100:
        from planning.roofline import calibrate_on_vidur, crosscheck_vidur, data_dir

        paths = {m: data_dir() / "profiles" / "h100" / m / "mlp.csv" for m in ("Llama-2-7b-hf", "Llama-2-70b-hf")}
        missing = [str(p) for p in paths.values() if not p.is_file()]
        if missing:
            print(f"{missing} not found (set PDCLUSTER_DATA)")
            return 1
        for m, path in paths.items():  # an uncalibrated guess, then the fitted defaults
            print(json.dumps({"model": m, "params": "guess mfu 0.5 bw_eff 0.8 no launch",
                              **crosscheck_vidur(path, mfu=0.5, bw_eff=0.8, launch_s=0.0)}))
            print(json.dumps({"model": m, "params": "defaults", **crosscheck_vidur(path)}))
        for train, test in (("Llama-2-7b-hf", "Llama-2-70b-hf"), ("Llama-2-70b-hf", "Llama-2-7b-hf")):
            fit = calibrate_on_vidur([paths[train]])
            held = crosscheck_vidur(paths[test], mfu=fit["mfu"], bw_eff=fit["bw_eff"], launch_s=fit["launch_s"])
            print(json.dumps({"fit_on": train, **fit, "held_out": test, "small": held["small"], "large": held["large"]}))
        return 0
    from planning.profile import TRANSPORTS, profile_engine

    transports = tuple(t for t in args.transports.split(",") if t)
    bad = [t for t in transports if t not in TRANSPORTS]
    if args.load_rate is not None and not (args.serving and args.load_rate > 0):
        print(f"pdcluster plan profile: --load-rate must be > 0 and needs --serving (got {args.load_rate}, "
              f"--serving {'on' if args.serving else 'off'})", file=sys.stderr)
        return 2
    if args.load_requests is not None and (args.load_requests < 4 or args.load_rate is None):
        print(f"pdcluster plan profile: --load-requests must be >= 4 and needs --load-rate (got "
              f"{args.load_requests})", file=sys.stderr)
        return 2
    if bad or args.page_size < 1:
        print(f"pdcluster plan profile: --transports must be a comma list of {', '.join(TRANSPORTS)} (got {bad}) "
              f"and --page-size >= 1 (got {args.page_size})", file=sys.stderr)
        return 2
    res = profile_engine(args.model, args.dtype, args.quick, transports=transports, page_size=args.page_size,
                         serving=args.serving, load_rate=args.load_rate,
                         load_requests=args.load_requests)
    Path(args.out).write_text(json.dumps(res, indent=2))
    for k, f in res["fit"].items():
        print(f"{k}: coef={f['coef']} r2={f['r2']:.3f} max_rel_err={f['max_rel_err']:.2f} n={f['n']}")
    delay = res["latency_model"]["meta"].get("first_token_delay_s")
    if delay is not None:
        print(f"served first-token delay over the engine's prefill: {delay * 1e3:.1f} ms")
    load = res.get("load")
    if load:
        print(f"under load ({args.load_rate:g} req/s, {load['requests']} streams): a decode step "
              f"x(1 + {load.get('load_base', 0.0):.2f}), x(1 + {load['load_same']:.2f}) per stream alongside on a "
              f"worker, x(1 + {load['load_other']:.2f}) per stream on a neighbour, "
              f"first token +{load['ttft_offset_s'] * 1e3:.1f} ms")
    print(f"wrote {args.out}")
    return 0
