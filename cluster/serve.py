"""`pdcluster serve`: start the cluster (a local one on 127.0.0.1 unless --address joins an
existing Ray cluster), print the router's address once it is SERVING, and on Ctrl-C or
SIGTERM drain (health NOT_SERVING, running requests finish within --grace) and stop every
process it started."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="cluster config YAML (flags below override its model/router/transport)")
    parser.add_argument("--model", help="checkpoint folder or built-in name (default: small)")
    parser.add_argument("--host", help="router bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="router port (default 50051; 0 picks a free one)")
    parser.add_argument("--prefill", type=int, default=1, help="prefill replicas (embedded config)")
    parser.add_argument("--decode", type=int, default=1, help="decode replicas (embedded config)")
    parser.add_argument("--kv-transport", choices=("nixl", "grpc"), help="KV transfer transport (default nixl)")
    parser.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    parser.add_argument("--policy", choices=("round-robin", "least-loaded", "prefix-aware"))
    parser.add_argument("--address", help="Ray address to join (default: start a local cluster on 127.0.0.1)")
    parser.add_argument("--migration-limit", type=int,
                        help="decode workers a request may lose and still continue on another (default 2; 0: off)")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="on SIGTERM/Ctrl-C: seconds running requests get to finish while health says NOT_SERVING "
                             "and new requests are refused (default 30); then they are cancelled")
    parser.add_argument("--metrics-port", type=int, default=9464,
                        help="Prometheus /metrics port on the router host (default 9464; 0 picks a free one; -1 off)")
    parser.add_argument("--ready-file", help="write the router address here once SERVING")


def load_config(args: argparse.Namespace):
    from cluster.config import ClusterConfig

    if args.config:
        cfg = ClusterConfig.from_yaml(args.config)
    else:
        cfg = ClusterConfig.embedded(prefill=args.prefill, decode=args.decode, mode=args.mode)
    updates: dict = {}
    if args.model:
        updates["model"] = args.model
    router = {k: v for k, v in (("host", args.host), ("port", args.port), ("policy", args.policy),
                                ("migration_limit", getattr(args, "migration_limit", None))) if v is not None}
    metrics_port = getattr(args, "metrics_port", None)
    if metrics_port is not None:
        router["metrics_port"] = None if metrics_port < 0 else metrics_port
    if router:
        updates["router"] = cfg.router.model_copy(update=router)
    if args.kv_transport:
        updates["transport"] = cfg.transport.model_copy(update={"kind": args.kv_transport})
    return ClusterConfig.model_validate({**cfg.model_dump(), **{k: (v.model_dump() if hasattr(v, "model_dump") else v)
                                                                  for k, v in updates.items()}})


def run(args: argparse.Namespace) -> int:
    from cluster.runtime import Cluster

    cfg = load_config(args)
    stop = threading.Event()

    def on_signal(*_) -> None:
        stop.set()

    def install() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    install()
    cluster = Cluster(cfg, address=args.address)
    pools = ", ".join(f"{p.name}: {p.replicas} x {p.role}" for p in cfg.pools)
    print(f"starting pdcluster ({cfg.model}; {pools}; kv over {cfg.transport.kind})", flush=True)
    try:
        address = cluster.start()
        install()  # ray.init installs its own SIGTERM handler (which exits at once): drain instead
        print(f"serving pdcluster.v1.Inference on {address} (Ctrl-C to stop)", flush=True)
        if cluster.metrics_url:
            print(f"metrics at {cluster.metrics_url}", flush=True)
        if args.ready_file:
            Path(args.ready_file).write_text(address)
        while not stop.wait(0.5):
            pass
        print("draining...", flush=True)
    finally:
        cluster.stop(args.grace)
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace()))
