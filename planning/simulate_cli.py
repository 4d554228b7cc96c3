"""`pdcluster plan simulate`: a cluster config (the YAML `serve` reads, or the same flags) on a
workload (the same flags as `bench serve`), in simulated time; prints `bench serve`'s table and
writes its JSON, so a prediction and a measurement line up field for field."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from loadgen.workload_args import add_workload_arguments

    p.add_argument("--config", help="cluster config YAML (as for `pdcluster serve`)")
    p.add_argument("--prefill", type=int, default=1, help="prefill replicas (embedded config)")
    p.add_argument("--decode", type=int, default=1, help="decode (or colocated) replicas (embedded config)")
    p.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    p.add_argument("--policy", choices=("round-robin", "least-loaded", "prefix-aware"))
    p.add_argument("--kv-transport", choices=("nixl", "grpc"))
    p.add_argument("--profile", help="profile JSON from `plan profile`: step times of pools without a GPU")
    p.add_argument("--pool-profile", action="append", default=[], metavar="POOL=FILE",
                   help="a profile for one pool (heterogeneous pools), repeatable")
    p.add_argument("--model-shape", help="roofline model for GPU pools: a preset (Llama-3-8B, ...) or a "
                                         "checkpoint folder; pools name their GPU in resources.accelerator_type")
    p.add_argument("--kv-store-size", metavar="SIZE[,SIZE...]",
                   help="each node's KV store, overriding the config's kv_store.size: auto, 0 (off) or bytes with "
                        "a unit (512MiB, 4GiB); a comma list simulates each size and prints hit rate and TTFT "
                        "by size")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=">= 2; for length fitting when neither config nor profile says (default 8192)")
    add_workload_arguments(p)
    p.add_argument("--exact-steps", action="store_true",
                   help="simulate every decode step as its own event (the same records, slower; for validation)")
    p.add_argument("--json", help="write every figure and per-request records here (bench serve's layout)")
    p.add_argument("--plot", help="write PNG plots into this directory")


def load_shape(name: str):
    from planning.roofline import PRESETS

    if name in PRESETS:
        return PRESETS[name]
    if Path(name).is_dir():
        from engine.config import ModelConfig

        return ModelConfig.from_pretrained(name)
    raise ValueError(f"--model-shape {name!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder")


def build_cluster(args: argparse.Namespace, kv_store_size: str | None = None):
    """(SimCluster, max_model_len) from the cluster and latency flags; ValueError on bad input.
    `kv_store_size`: overrides the config's kv_store.size."""
    from planning.latency import LatencyModel
    from planning.sim_config import DEFAULT_MAX_MODEL_LEN, sim_cluster
    from cluster.serve import load_config

    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    for flag, v in (("--prefill", args.prefill), ("--decode", args.decode)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    ns = argparse.Namespace(config=args.config, prefill=args.prefill, decode=args.decode, mode=args.mode,
                            model=None, host=None, port=None, policy=args.policy, kv_transport=args.kv_transport)
    cfg = load_config(ns)
    profile = LatencyModel.load(args.profile) if args.profile else None
    pool_profiles = {}
    for item in args.pool_profile:
        name, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"--pool-profile must be POOL=FILE, got {item!r}")
        pool_profiles[name] = LatencyModel.load(path)
    shape = load_shape(args.model_shape) if args.model_shape else None
    max_len = cfg.max_model_len or args.max_model_len or (profile.meta.get("max_model_len") if profile else None) \
        or DEFAULT_MAX_MODEL_LEN
    return sim_cluster(cfg, profile=profile, pool_profiles=pool_profiles, shape=shape, max_model_len=max_len,
                       kv_store_size=kv_store_size), max_len


def store_sizes(text: str | None) -> list[str | None]:
    """The --kv-store-size list (ValueError naming the flag for a bad size); [None]: the config's."""
    from cluster.config_kv_store import parse_size

    if text is None:
        return [None]
    sizes = [t.strip() for t in text.split(",")]
    for t in sizes:
        parse_size(t, "--kv-store-size")
    return sizes


def _mib(n: int) -> str:
    return f"{n / (1 << 30):.4g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.4g} MiB"


def format_tiers(cluster, t: dict) -> str:
    """The prompt tokens' sources and the stores, two lines."""
    tok, rate, f = t["tokens"], t["hit_rate"], t["fetches"]
    lines = [f"prompt tokens {t['prompt_tokens']}: own cache {rate['own_cache']:.1%}, peer fetch {rate['peer']:.1%}, "
             f"KV store {rate['store']:.1%}, computed {tok['computed'] / max(t['prompt_tokens'], 1):.1%}; "
             f"fetches: store {f['store']}, peer {f['peer']}"]
    stores = t.get("stores") or {}
    if stores:
        st = next(iter(stores.values()))
        lines.append(f"KV store {_mib(cluster.kv_store_bytes)} per node x {len(stores)}: {st['capacity_pages']} "
                     f"pages of {_mib(st['bytes_per_page'])}; copied {sum(x['copied_pages'] for x in stores.values())}, "
                     f"evicted {sum(x['evicted_pages'] for x in stores.values())} pages"
                     + ("" if t.get("active") else " (idle: the workload shares no prefix blocks)")
                     + ("" if st["bytes_per_page"] else " (the latency model has no kv_bytes_per_token: the store "
                                                        "holds nothing)"))
    else:
        lines.append("KV store off" + (f"; peer fetch at >= {cluster.fetch_min_pages} pages" if cluster.fetch_min_pages
                                       else ""))
    return "\n".join("  " + x for x in lines)


def run(args: argparse.Namespace) -> int:
    from loadgen import report
    from loadgen.metrics import summarize
    from loadgen.workload_args import validate_workload_arguments, workload_from_args
    from planning.simulator import simulate

    try:
        percentiles, slo = validate_workload_arguments(args)
        sizes = store_sizes(getattr(args, "kv_store_size", None))
        cluster, max_len = build_cluster(args, sizes[0])
        wl = workload_from_args(args, max_len)
    except (ValueError, OSError) as exc:
        print(f"pdcluster plan simulate: {exc}", file=sys.stderr)
        return 2
    if len(sizes) > 1:
        return _sweep(args, sizes, wl, percentiles, slo)
    res = simulate(cluster, wl, args.max_concurrency, exact_steps=args.exact_steps)
    summary = summarize(res.records, res.duration_s, percentiles, slo or None)
    print(f"simulated {len(wl.requests)} requests on {cluster.describe()} in {res.wall_s:.2f} s")
    print(report.format_table(summary))
    for name, w in res.workers.items():
        print(f"  {name:<14} {w['role']:<9} busy {w['busy_fraction']:6.1%}  steps {w['steps']:>7}  "
              f"mean decode batch {w['mean_decode_batch']:6.2f}  preemptions {w['preemptions']}")
    print(format_tiers(cluster, res.kv_tiers))
    if args.json:
        config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        config.update(simulated=True, cluster=cluster.describe(), workload=wl.name, workload_meta=wl.meta,
                      block_tokens=wl.block_tokens, workers=res.workers, sim_wall_s=res.wall_s,
                      kv_store_bytes=cluster.kv_store_bytes, kv_tiers=res.kv_tiers)
        report.write_json(args.json, summary, res.records, config)
    if args.plot:
        report.write_plots(args.plot, res.records, res.timeline)
    return 0


def _sweep(args: argparse.Namespace, sizes: list[str], wl, percentiles, slo) -> int:
    """One simulation per store size: hit rates, fetches and TTFT by size."""
    import json

    from loadgen.metrics import summarize
    from planning.simulator import simulate

    rows = []
    print(f"{len(wl.requests)} requests of {wl.name}, one simulation per KV store size")
    print(f"{'store/node':>12} {'pages, all':>10} {'own':>7} {'peer':>7} {'store':>7} {'total':>7} {'fetches':>8} "
          f"{'TTFT p50':>10} {'TTFT p90':>10} {'wall':>7}")
    for size in sizes:
        cluster, _ = build_cluster(args, size)
        res = simulate(cluster, wl, args.max_concurrency, exact_steps=args.exact_steps)
        summary = summarize(res.records, res.duration_s, percentiles, slo or None)
        t, ttft = res.kv_tiers, summary["ttft_ms"]
        rate = t["hit_rate"]
        pages = sum(st["capacity_pages"] for st in (t.get("stores") or {}).values())
        print(f"{size:>12} {pages:>10} {rate['own_cache']:7.1%} {rate['peer']:7.1%} {rate['store']:7.1%} "
              f"{rate['total']:7.1%} {sum(t['fetches'].values()):>8} {ttft.get('p50', 0):8.1f}ms "
              f"{ttft.get('p90', 0):8.1f}ms {res.wall_s:6.1f}s")
        rows.append({"kv_store_size": size, "kv_store_bytes": cluster.kv_store_bytes, "kv_tiers": t,
                     "summary": summary, "workers": res.workers, "sim_wall_s": res.wall_s})
    if args.json:
        from pathlib import Path

        config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        config.update(simulated=True, cluster=cluster.describe(), workload=wl.name, workload_meta=wl.meta)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": config, "sweep": rows}, indent=1))
    return 0
