"""Simulator speed: an hour of a trace on 2 prefill + 2 decode Llama-3-8B/H100 workers (30,000
pages each), the setup docs/capacity-planning.md times. Prints the wall time and a digest of
the per-request records, so two simulators (or --exact-steps against the default) can be
compared on both speed and output (the CPU time is the steadier figure on a shared machine):

    python -m planning.sim_bench --dataset azure-conv [--exact-steps] [--num-requests N] [--kv-store-size 64GiB]
"""
from __future__ import annotations

import argparse
import hashlib
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planning.sim_bench")
    p.add_argument("--dataset", default="azure-conv")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--exact-steps", action="store_true", help="step every decode step one by one")
    p.add_argument("--profile", action="store_true", help="print a cProfile of the run")
    p.add_argument("--kv-store-size", default="0", help="each decode worker's node KV store (sim_store.py): 0 (off, "
                                                       "the default), auto (4 GiB on a GPU server) or bytes: 64GiB")
    args = p.parse_args(argv)

    from loadgen.workloads import build_workload
    from cluster.config_kv_store import KVStoreSettings
    from planning.hardware import get_gpu
    from planning.sim_config import GPU_NODE_MEMORY
    from planning.roofline import model_shape, roofline_latency_model
    from planning.sim_request import EngineLimits
    from planning.sim_spec import SimCluster, SimPool
    from planning.simulator import simulate

    lm = roofline_latency_model(model_shape("Llama-3-8B"), get_gpu("H100"))
    limits = EngineLimits(16, 30000, 8192, 256)
    c = SimCluster([SimPool("p", "prefill", 2, lm, limits), SimPool("d", "decode", 2, lm, limits)],
                   max_inflight=4096, max_queue=1 << 20,
                   kv_store_bytes=KVStoreSettings(size=args.kv_store_size).size_bytes(GPU_NODE_MEMORY))
    kw = {"num_requests": args.num_requests} if args.num_requests else {}
    w = build_workload(args.dataset, **kw)
    extra = {"exact_steps": True} if args.exact_steps else {}
    t0, c0 = time.perf_counter(), time.process_time()
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        res = prof.runcall(simulate, c, w, **extra)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    else:
        res = simulate(c, w, **extra)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    digest = hashlib.sha256(repr([(r.index, r.ok, r.ttft_s, r.chunk_times_s) for r in res.records]).encode())
    steps = sum(x["steps"] for x in res.workers.values())
    print(f"{args.dataset}: {len(w.requests)} requests, {res.duration_s:.0f} s simulated, {steps} steps, "
          f"wall {wall:.2f} s, cpu {cpu:.2f} s{' (exact steps)' if args.exact_steps else ''}; records {digest.hexdigest()[:16]}")
    if c.kv_store_bytes:
        t = res.kv_tiers
        print(f"  KV store {args.kv_store_size} per node: hit rate own {t['hit_rate']['own_cache']:.1%}, "
              f"store {t['hit_rate']['store']:.1%}; fetches {t['fetches']['store']}"
              + ("" if t.get("active") else " (idle: no shared prefix blocks)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
