"""`pdcluster plan search`: rank pool configurations (P:D counts, GPU type and TP per pool,
disaggregated or colocated) for a model, a workload and SLOs within a GPU inventory."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from loadgen.workload_args import add_workload_arguments

    p.add_argument("--model-shape", default="Llama-3-8B", help="a roofline preset or a checkpoint folder")
    p.add_argument("--inventory", help="GPUs available by type, e.g. '8xH100,8xH200' (or H100=8,...)")
    p.add_argument("--max-gpus", type=int, help=">= 1 GPUs in all (default: the inventory's total)")
    p.add_argument("--gpu-types", help="with --max-gpus and no --inventory: the types to choose from, comma list")
    p.add_argument("--tp", default="1,2,4", help="tensor-parallel degrees to try, comma list")
    p.add_argument("--modes", default="disaggregated,colocated", help="comma list of disaggregated, colocated")
    p.add_argument("--price", action="append", default=[], metavar="GPU=USD_PER_HOUR", help="override a GPU's price")
    p.add_argument("--attainment", type=float, default=0.9, help="fraction of requests that must meet every SLO")
    p.add_argument("--objective", default="per-dollar", choices=("goodput", "per-gpu", "per-dollar"))
    p.add_argument("--verify", type=int, default=6, help=">= 0 best plans to simulate end to end")
    p.add_argument("--top", type=int, default=15, help="rows to print")
    p.add_argument("--jobs", type=int, default=None,
                   help=">= 1 simulations at once, in processes (default: the CPUs this process may use)")
    p.add_argument("--exact-steps", action="store_true",
                   help="simulate every decode step as its own event (the same plans, slower; for validation)")
    p.add_argument("--max-model-len", type=int, default=8192, help="for length fitting (default 8192)")
    add_workload_arguments(p)
    p.set_defaults(num_requests=1000)
    p.add_argument("--json", help="write every plan and the instance capacities here")
    p.add_argument("--plot", help="write the price/goodput Pareto front as a PNG here")


def parse_inventory(text: str) -> dict[str, int]:
    from planning.hardware import get_gpu

    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"(\d+)\s*x\s*(\S+)|(\S+?)\s*=\s*(\d+)", item)
        if not m:
            raise ValueError(f"--inventory item {item!r}: expected COUNTxGPU or GPU=COUNT")
        count, name = (int(m[1]), m[2]) if m[1] else (int(m[4]), m[3])
        if count < 1:
            raise ValueError(f"--inventory item {item!r}: count must be >= 1")
        gpu = get_gpu(name).name
        out[gpu] = out.get(gpu, 0) + count
    if not out:
        raise ValueError("--inventory lists no GPUs")
    return out


def build_space(args: argparse.Namespace, shape):
    from dataclasses import replace

    from planning.hardware import get_gpu
    from planning.roofline import roofline_latency_model
    from planning.search import Instance, SearchSpace
    from planning.sim_config import gpu_num_pages

    if args.inventory:
        inventory = parse_inventory(args.inventory)
    elif args.max_gpus and args.gpu_types:
        inventory = {get_gpu(g).name: args.max_gpus for g in args.gpu_types.split(",") if g}
    else:
        raise ValueError("give --inventory (e.g. 8xH100,8xH200), or --max-gpus with --gpu-types")
    max_gpus = args.max_gpus or sum(inventory.values())
    if max_gpus < 1:
        raise ValueError(f"--max-gpus must be >= 1, got {max_gpus}")
    try:
        tps = sorted({int(t) for t in args.tp.split(",") if t})
    except ValueError:
        raise ValueError(f"--tp must be a comma list of integers, got {args.tp!r}") from None
    if not tps or any(t < 1 for t in tps):
        raise ValueError(f"--tp values must be >= 1, got {args.tp!r}")
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or any(m not in ("disaggregated", "colocated") for m in modes):
        raise ValueError(f"--modes must be a comma list of disaggregated, colocated, got {args.modes!r}")
    prices = {}
    for item in args.price:
        name, sep, usd = item.partition("=")
        try:
            prices[get_gpu(name).name] = float(usd)
        except ValueError:
            raise ValueError(f"--price must be GPU=USD_PER_HOUR with a known GPU, got {item!r}") from None
    instances = []
    for gname in inventory:
        gpu = get_gpu(gname)
        gpu = replace(gpu, price_per_hour=prices.get(gpu.name, gpu.price_per_hour))
        for tp in tps:
            if tp > min(inventory[gname], max_gpus):
                continue
            try:
                pages = gpu_num_pages(shape, gpu, tp, 16)
            except ValueError:
                continue  # the weights do not fit at this TP
            instances.append(Instance(gpu.name, tp, roofline_latency_model(shape, gpu, tp, max_batched_tokens=8192),
                                      pages, gpu.price_per_hour * tp))
    if not instances:
        raise ValueError("the model fits on none of the inventory's GPUs at the given --tp degrees")
    return SearchSpace(instances, inventory, max_gpus, modes, exact_steps=args.exact_steps)


def run(args: argparse.Namespace) -> int:
    from loadgen.workload_args import validate_workload_arguments, workload_from_args
    from planning.search import default_jobs, pareto_front, search
    from planning.simulate_cli import load_shape

    try:
        _, slo = validate_workload_arguments(args)
        if not slo:
            raise ValueError("--goodput needs at least one SLO, e.g. --goodput ttft:2000 tpot:100")
        if not 0 < args.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        if args.verify < 0 or args.top < 1:
            raise ValueError(f"--verify must be >= 0 and --top >= 1, got {args.verify}, {args.top}")
        shape = load_shape(args.model_shape)
        space = build_space(args, shape)
        wl = workload_from_args(args, args.max_model_len)
    except (ValueError, OSError) as exc:
        print(f"pdcluster plan search: {exc}", file=sys.stderr)
        return 2
    log = (lambda s: None) if getattr(args, "quiet", False) else (lambda s: print("  " + s, flush=True))
    plans = search(space, wl, slo, target=args.attainment, objective=args.objective, verify=args.verify, progress=log,
                   jobs=args.jobs or default_jobs())
    print(format_table(plans[: args.top], slo, args.attainment, wl))
    if args.json:
        Path(args.json).write_text(json.dumps({"slo_ms": slo, "attainment_target": args.attainment,
                                               "objective": args.objective, "workload": wl.name,
                                               "num_requests": len(wl.requests), "plans": [_plan_json(p) for p in plans]},
                                              indent=1))
    if args.plot:
        write_pareto_plot(args.plot, plans, pareto_front(plans))
    return 0


def format_table(plans, slo, target, wl) -> str:
    reqs = wl.requests
    rate = (len(reqs) - 1) / (reqs[-1].arrival_s - reqs[0].arrival_s) if reqs[-1].arrival_s > reqs[0].arrival_s else 0
    slo_text = " ".join(f"{k}<={v:g}ms" for k, v in slo.items())
    head = ["#", "plan", "GPUs", "$/h", "goodput", "/GPU", "req/$", f"attain@{rate:.2f}/s", "checked"]
    rows = [head]
    for i, p in enumerate(plans, 1):
        g = p.best_goodput
        rows.append([str(i), p.describe(), str(p.gpus), f"{p.price_per_hour:.1f}", f"{g:.2f}",
                     f"{g / p.gpus:.3f}", f"{g * 3600 / p.price_per_hour:.0f}" if p.price_per_hour else "-",
                     "-" if p.attainment is None else f"{p.attainment:.1%}", "sim" if p.verified else "estimate"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"SLO {slo_text}, {target:.0%} of requests; goodput = highest req/s meeting it"]
    lines += ["  ".join(c.rjust(w) if k not in (1,) else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths)))
              for r in rows]
    return "\n".join(lines)


def _plan_json(p) -> dict:
    return {"plan": p.describe(), "mode": p.mode, "gpus": p.gpus, "price_per_hour": p.price_per_hour,
            "estimate": p.estimate, "goodput": p.goodput, "attainment": p.attainment, "verified": p.verified,
            "pools": [{"role": r, "replicas": n, "gpu": i.gpu, "tp": i.tp, "num_pages": i.num_pages} for r, n, i in p.pools]}


def write_pareto_plot(path: str, plans, front) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in (("disaggregated", "o"), ("colocated", "s")):
        pts = [(p.price_per_hour, p.best_goodput) for p in plans if p.mode == mode]
        if pts:
            ax.scatter(*zip(*pts), s=10, alpha=0.35, marker=marker, label=mode)
    ax.plot([p.price_per_hour for p in front], [p.best_goodput for p in front], "k-", lw=1.2, label="Pareto front")
    for p in front[-6:]:
        ax.annotate(p.describe(), (p.price_per_hour, p.best_goodput), fontsize=6)
    ax.set_xlabel("price ($/hour)")
    ax.set_ylabel("goodput (req/s under the SLO)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
