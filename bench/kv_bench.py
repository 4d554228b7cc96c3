"""`pdcluster bench kv`: KV transfer bandwidth between two processes, against baselines
measured in the same run (bench/kv_baselines.py: single-thread memcpy, one raw NIXL READ of
one contiguous buffer, a raw loopback TCP socket, bare gRPC streams of `chunk_bytes` bytes
messages with no page handling, one per data lane). Payload: Llama-3-8B-shaped KV (32
layers, 8 kv heads, head dim 128, bf16, page 16) for a 4,096-token prompt (~512 MiB). The
receiver lives in this process, the sender in a spawned child (loadgen/kv.py, loadgen/kv_child.py).

Every figure is sampled once per round, all figures in turns, after one untimed warm-up
round; GB/s figures are medians over rounds, ratios are medians of each round's pair (a
figure and its baseline measured seconds apart, so a burst of background load on this
shared machine hits both), every sample is in `samples`. Layer-wise overlap runs right after
each round's plain nixl transfer, with one layer's simulated compute = that transfer / layers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from loadgen.kv import Paged, spawn_child, stop_child

TARGETS = {"nixl_vs_raw_nixl": 0.9, "grpc_vs_raw_tcp": 0.5, "layerwise_overlap": 1.15, "descriptor_setup_ms": 0.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="OUT", help="write the figures as JSON here")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096, ~512 MiB)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="rounds (one sample of every figure each); medians reported")
    parser.add_argument("--only", default="", help="comma-separated subset of memcpy,raw_nixl,raw_tcp,raw_grpc,"
                                                   "nixl,nixl_per_layer,grpc,layerwise (default: all)")
    parser.add_argument("--grpc-chunk-bytes", type=int, default=None, help="TransferConfig.chunk_bytes (grpc)")
    parser.add_argument("--grpc-inflight", type=int, default=None, help="TransferConfig.max_inflight_chunks (grpc)")
    parser.add_argument("--grpc-streams", type=int, default=None, help="TransferConfig.grpc_streams (grpc data lanes)")


def _median_ratio(pairs: list[tuple[float, float]]) -> float:
    """Median over samples of baseline seconds / measured seconds (a throughput ratio)."""
    return statistics.median(base / t for base, t in pairs)


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    from bench.kv_baselines import Memcpy, RawGrpc, RawNixl, RawTcp
    from kv_transfer.layout import KVLayout, KVPool, ModelSpec

    torch.set_num_threads(1)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    spec_kw = dict(model_id="llama-3-8b-shape", num_layers=args.layers, num_kv_heads=args.kv_heads,
                   head_dim=args.head_dim)
    layout_kw = dict(num_layers=args.layers, page_size=args.page_size, head_start=0, num_heads=args.kv_heads,
                     head_dim=args.head_dim, dtype="bfloat16")
    layout = KVLayout(**layout_kw)
    num_pages = layout.pages_for(args.tokens)
    nbytes = num_pages * layout.page_bytes * args.layers
    pool = KVPool.allocate(ModelSpec(**spec_kw), layout, num_pages)
    r = max(1, args.repeats)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    want = (lambda name: not only or name in only)  # noqa: E731
    grpc_kw = {k: v for k, v in (("chunk_bytes", args.grpc_chunk_bytes), ("max_inflight_chunks", args.grpc_inflight),
                                 ("grpc_streams", args.grpc_streams)) if v is not None}
    from kv_transfer.config import TransferConfig

    lanes = TransferConfig(**grpc_kw).grpc_streams
    conn, child = spawn_child(spec_kw, layout_kw, num_pages)
    probes: dict = {}
    try:
        # every figure is sampled once per round, in turns, so a burst of background load
        # hits a figure and the baseline it is compared with alike
        if want("memcpy"):
            probes["memcpy"] = Memcpy(nbytes)
        if want("raw_nixl"):
            probes["raw_nixl"] = RawNixl(conn, nbytes)
        if want("nixl") or want("layerwise"):
            probes["nixl"] = Paged(conn, "nixl", pool, args.tokens)
        if want("nixl_per_layer"):
            # the same transport with one READ per layer however many layers are ready at once:
            # what coalescing consecutive ready layers buys, in the same run
            probes["nixl_per_layer"] = Paged(conn, "nixl", pool, args.tokens, {"nixl_coalesce_reads": False},
                                             name="nixl_per_layer")
        if want("raw_tcp"):
            probes["raw_tcp"] = RawTcp(conn, nbytes)
        if want("raw_grpc"):
            probes["raw_grpc"] = RawGrpc(conn, nbytes, TransferConfig(**grpc_kw).chunk_bytes, 1)
            if lanes > 1:
                probes["raw_grpc_lanes"] = RawGrpc(conn, nbytes, TransferConfig(**grpc_kw).chunk_bytes, lanes)
        if want("grpc"):
            probes["grpc"] = Paged(conn, "grpc", pool, args.tokens, grpc_kw)
        samples: dict[str, list[float]] = {}
        for round_ in range(-1, r):  # round -1 is an untimed warm-up (it faults pages in)
            keep = round_ >= 0
            for name, probe in probes.items():
                if not isinstance(probe, Paged):
                    _add(samples, keep, **{f"{name}_s": probe.once()})
                    continue
                elapsed, cpu, wall, _ = probe.once()
                _add(samples, keep, **{f"{name}_s": elapsed})
                if name == "nixl_per_layer":
                    _add(samples, keep, descriptor_setup_per_layer_s=cpu)
                if name == "nixl":
                    _add(samples, keep, descriptor_setup_s=cpu, descriptor_setup_wall_s=wall,
                         nixl_reads_per_request=probe.last_reads)
                    if want("layerwise"):
                        # simulated compute per layer = one layer's transfer, measured just now
                        layer_s = elapsed / args.layers
                        e2e, cpu, _, computed = probe.once(compute_s=layer_s)
                        _add(samples, keep, layer_transfer_s=layer_s, layerwise_e2e_s=e2e,
                             layerwise_compute_s=computed, descriptor_setup_layerwise_s=cpu)
        res = _figures(samples, nbytes, args, r)
        if grpc_kw:
            res["grpc_config"] = grpc_kw
        res["grpc_streams"] = lanes
    finally:
        for probe in probes.values():
            probe.close()
        stop_child(conn, child)
    _print(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _add(samples: dict[str, list[float]], keep: bool, **values: float) -> None:
    if keep:
        for key, value in values.items():
            samples.setdefault(key, []).append(value)


def _figures(samples: dict[str, list[float]], nbytes: int, args: argparse.Namespace, repeats: int) -> dict:
    res: dict = {"tokens": args.tokens, "payload_bytes": nbytes, "layers": args.layers, "repeats": repeats}
    for name in ("memcpy", "raw_nixl", "raw_tcp", "raw_grpc", "raw_grpc_lanes", "nixl", "nixl_per_layer", "grpc"):
        if f"{name}_s" in samples:
            res[f"{name}_gbps"] = nbytes / statistics.median(samples[f"{name}_s"]) / 1e9
    if "descriptor_setup_s" in samples:
        # set-up work of one request (its receiver thread's CPU time over its index arrays and
        # prepared transfers); the wall figure also holds GIL waits and preemption
        res["descriptor_setup_ms"] = statistics.median(samples["descriptor_setup_s"]) * 1e3
        res["descriptor_setup_wall_ms"] = statistics.median(samples["descriptor_setup_wall_s"]) * 1e3
    if "nixl_reads_per_request" in samples:  # READs one 32-layer request took (coalescing at work)
        res["nixl_reads_per_request"] = statistics.median(samples["nixl_reads_per_request"])
    for key in ("descriptor_setup_layerwise", "descriptor_setup_per_layer"):
        # the same, for requests whose layers came one by one, and for one READ per layer
        if f"{key}_s" in samples:
            res[f"{key}_ms"] = statistics.median(samples[f"{key}_s"]) * 1e3
    if "layerwise_e2e_s" in samples:
        e2e, comp, layer = samples["layerwise_e2e_s"], samples["layerwise_compute_s"], samples["layer_transfer_s"]
        res["layer_transfer_ms"] = statistics.median(layer) * 1e3
        res["layerwise_e2e_ms"] = statistics.median(e2e) * 1e3
        res["layerwise_compute_ms"] = statistics.median(comp) * 1e3
        # against the compute the sender really did (a sleep overshoots under load) plus one
        # layer's transfer measured in the same round: 1.0 = the transfer hid behind compute
        res["layerwise_overlap"] = statistics.median(e / (c + lt) for e, c, lt in zip(e2e, comp, layer))
    # ratios: the median over rounds of each round's pair, taken side by side
    for key, num, den in (("nixl_vs_raw_nixl", "nixl", "raw_nixl"), ("nixl_per_layer_vs_raw_nixl", "nixl_per_layer", "raw_nixl"),
                          ("grpc_vs_raw_tcp", "grpc", "raw_tcp"),
                          ("grpc_vs_raw_grpc", "grpc", "raw_grpc"), ("grpc_vs_raw_grpc_lanes", "grpc", "raw_grpc_lanes"),
                          ("raw_grpc_vs_raw_tcp", "raw_grpc", "raw_tcp"),
                          ("raw_grpc_lanes_vs_raw_tcp", "raw_grpc_lanes", "raw_tcp"), ("nixl_vs_memcpy", "nixl", "memcpy")):
        if f"{num}_s" in samples and f"{den}_s" in samples:
            res[key] = _median_ratio(list(zip(samples[f"{den}_s"], samples[f"{num}_s"])))
    res["targets"] = TARGETS
    res["samples"] = samples
    return res


def _print(res: dict) -> None:
    print(f"KV transfer, {res['tokens']} tokens, {res['layers']} layers, {res['payload_bytes'] / 2**20:.0f} MiB, "
          f"medians of {res['repeats']} rounds (ratios: median of per-round pairs); grpc lanes {res['grpc_streams']}")
    rows = [(key, "GB/s", "") for key in ("memcpy_gbps", "raw_nixl_gbps", "raw_tcp_gbps", "raw_grpc_gbps",
                                          "raw_grpc_lanes_gbps", "nixl_gbps", "nixl_per_layer_gbps", "grpc_gbps")]
    rows += [("descriptor_setup_ms", "ms", "(target <= 0.5)"), ("descriptor_setup_wall_ms", "ms", ""),
             ("descriptor_setup_layerwise_ms", "ms", ""), ("descriptor_setup_per_layer_ms", "ms", ""),
             ("nixl_reads_per_request", "", ""),
             ("layer_transfer_ms", "ms", ""), ("layerwise_e2e_ms", "ms", ""),
             ("layerwise_overlap", "", "(target <= 1.15)"), ("nixl_vs_raw_nixl", "", "(target >= 0.9)"),
             ("nixl_per_layer_vs_raw_nixl", "", ""),
             ("grpc_vs_raw_tcp", "", "(target >= 0.5)"), ("grpc_vs_raw_grpc", "", ""),
             ("grpc_vs_raw_grpc_lanes", "", ""), ("raw_grpc_vs_raw_tcp", "", ""),
             ("raw_grpc_lanes_vs_raw_tcp", "", ""), ("nixl_vs_memcpy", "", "")]
    for key, unit, note in rows:
        if res.get(key) is not None:
            print(f"  {key:<26}{res[key]:>10.3f} {unit:<5}{note}")


if __name__ == "__main__":
    from cluster.cli import main

    sys.exit(main(["bench", "kv", *sys.argv[1:]]))
