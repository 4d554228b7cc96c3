"""What a node KV store costs to have (kv_store/store.py): building one (its memory allocated and
registered with the transport) and its resident memory, per size and transport, and a local Ray
cluster's start with the store on against off, in the same run.

    PYTHONPATH=. python scripts/kv_store_cost.py --model small --sizes 256MiB 1536MiB \
        --clusters 2 --out /tmp/kv_store_cost.json

Prints a table and writes the rows as JSON. Not a test: numbers on a shared machine are noisy,
compare only the figures of one run.
"""
from __future__ import annotations

import argparse
import json
import time


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def build(model: str, size: int, transport: str) -> dict:
    from kv_store import KVStore

    before = _rss_mib()
    t0 = time.perf_counter()
    s = KVStore(model, size_bytes=size, page_size=16, transport=transport)
    took = time.perf_counter() - t0
    row = dict(transport=transport, size_mib=size / 2**20, pages=s.kv.num_pages, page_bytes=s.page_bytes,
               build_s=round(took, 3), rss_growth_mib=round(_rss_mib() - before, 1))
    s.close()
    return row


def cluster_start(model: str, size: str) -> float:
    from cluster.config import ClusterConfig
    from cluster.runtime import Cluster

    cfg = ClusterConfig.embedded(model=model, port=0)
    cfg = ClusterConfig.model_validate({**cfg.model_dump(), "kv_store": {"size": size}})
    c = Cluster(cfg)
    t0 = time.perf_counter()
    c.start()
    took = time.perf_counter() - t0
    c.stop()
    return took


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small")
    p.add_argument("--sizes", nargs="+", default=["256MiB", "1536MiB"])
    p.add_argument("--transports", nargs="+", default=["nixl", "grpc"])
    p.add_argument("--clusters", type=int, default=2, help="cluster starts per arm (store on, off), alternating")
    p.add_argument("--out", default="kv_store_cost.json")
    args = p.parse_args()
    from cluster.config_kv_store import parse_size

    rows = [build(args.model, parse_size(s), t) for s in args.sizes for t in args.transports]
    print(f"{'transport':<10}{'size MiB':>10}{'pages':>8}{'build s':>9}{'RSS +MiB':>10}")
    for r in rows:
        print(f"{r['transport']:<10}{r['size_mib']:>10.0f}{r['pages']:>8}{r['build_s']:>9.3f}{r['rss_growth_mib']:>10.1f}")
    starts: dict[str, list[float]] = {"auto": [], "0": []}
    for _ in range(args.clusters):
        for size in ("auto", "0"):
            starts[size].append(round(cluster_start(args.model, size), 2))
    for size, ts in starts.items():
        print(f"cluster start, kv_store.size {size}: {ts} s")
    on, off = min(starts["auto"] or [0]), min(starts["0"] or [0])
    if off:
        print(f"best of each: store on / off = {on / off:.2f}x ({on - off:+.2f} s)")
    with open(args.out, "w") as f:
        json.dump({"stores": rows, "cluster_start_s": starts}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
