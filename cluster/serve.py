"""`pdcluster serve`: start the cluster (a local one on 127.0.0.1 unless --address joins an
existing Ray cluster), print each router's address once it is SERVING, and on Ctrl-C or
SIGTERM drain (health NOT_SERVING, running requests finish within --grace) and stop every
process it started.

While it runs, a lost router (its process killed or crashed) is restarted by Ray and started
again by the cluster's supervisor on the same ports: serve prints a line when the loss is seen
and one when the router serves again. A router that cannot come back (router.max_restarts
spent, or not serving within a minute) ends serve with exit code 1, saying which and why."""
from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import threading
from pathlib import Path

API_KEYS_ENV = "PDCLUSTER_API_KEYS"  # as router.security's: read here, so the CLI imports no grpc


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
    parser.add_argument("--kv-store-size", help="each node's KV store (docs/kv-cache.md): auto (1/16 of the node's "
                                                "memory, at most 4 GiB; the default), bytes with a unit (512MiB, "
                                                "2GiB), or 0 (off)")
    eng = parser.add_argument_group("engine settings of every pool (override the config's)")
    eng.add_argument("--dtype", help="weights and KV cache dtype: float32, bfloat16, float16 (default: float32 on "
                                     "CPU, bfloat16 on GPU)")
    eng.add_argument("--max-model-len", type=int, help="longest sequence, prompt plus output, in tokens "
                                                       "(default: the model's)")
    eng.add_argument("--page-size", type=int, help="tokens per KV cache page (default 16)")
    eng.add_argument("--num-pages", type=int, help="KV cache size of each worker, in pages (default: from the KV "
                                                   "memory budget)")
    eng.add_argument("--max-num-seqs", type=int, help="most sequences one worker batches (default 64)")
    eng.add_argument("--tp", type=int, help="tensor-parallel size of every pool's workers (default: the config's, "
                                            "else 1); --prefill-tp and --decode-tp override it per role")
    eng.add_argument("--prefill-tp", type=int, help="tensor-parallel size of the prefill pools' workers")
    eng.add_argument("--decode-tp", type=int, help="tensor-parallel size of the decode pools' workers, and of the "
                                                   "colocated pools' (they decode too)")
    parser.add_argument("--migration-limit", type=int,
                        help="decode workers a request may lose and still continue on another (default 2; 0: off)")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="on SIGTERM/Ctrl-C: seconds running requests get to finish while health says NOT_SERVING "
                             "and new requests are refused (default 30); then they are cancelled")
    parser.add_argument("--metrics-port", type=int, default=9464,
                        help="Prometheus /metrics port on the router host (default 9464; 0 picks a free one; -1 off)")
    parser.add_argument("--http-port", type=int, default=8000,
                        help="OpenAI-compatible HTTP API port on the router host (default 8000; 0 picks a free one; "
                             "-1 off)")
    parser.add_argument("--routers", type=int, help="router replicas, each an actor on its own ports (router i on "
                                                    "port+i, http-port+i, metrics-port+i); default 1")
    parser.add_argument("--request-log", help="one JSON line per finished or failed request: a file on the "
                                              "routers' host (appended), or - for the router processes' "
                                              "standard error (Ray's log files of a local cluster)")
    parser.add_argument("--ready-file", help="write router 0's address here once every router is SERVING")
    sec = parser.add_argument_group("locks on the client-facing doors (gRPC, HTTP, /metrics)")
    sec.add_argument("--api-key", action="append", default=None,
                     help="require this key on every RPC and route (repeatable; also $PDCLUSTER_API_KEYS, "
                          "comma-separated)")
    sec.add_argument("--tls-cert", help="PEM certificate: serve over TLS (with --tls-key)")
    sec.add_argument("--tls-key", help="PEM private key of --tls-cert")
    sec.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    sec.add_argument("--open-health", action="store_true", help="with keys: answer grpc.health.v1 without one")
    sec.add_argument("--open-metrics", action="store_true", help="with keys: serve /metrics without one")
    sec.add_argument("--insecure", action="store_true",
                     help="allow a non-loopback --host without TLS and an API key (only behind your own locks)")


def load_config(args: argparse.Namespace):
    from cluster.config import ClusterConfig

    if args.config:
        cfg = ClusterConfig.from_yaml(args.config)
    else:  # the embedded default reserves this machine's CPUs for the workers it starts
        cfg = ClusterConfig.embedded(prefill=args.prefill, decode=args.decode, mode=args.mode)
    updates: dict = {}
    if args.model:
        updates["model"] = args.model
    router = {k: v for k, v in (("host", args.host), ("port", args.port), ("policy", args.policy),
                                ("migration_limit", getattr(args, "migration_limit", None)),
                                ("replicas", getattr(args, "routers", None)),
                                ("request_log", getattr(args, "request_log", None))) if v is not None}
    metrics_port = getattr(args, "metrics_port", None)
    if metrics_port is not None:
        router["metrics_port"] = None if metrics_port < 0 else metrics_port
    keys = list(getattr(args, "api_key", None) or [])
    env_keys = os.environ.get(API_KEYS_ENV, "")
    keys += [k.strip() for k in env_keys.split(",") if k.strip()]
    if keys:
        router["api_keys"] = keys
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        if getattr(args, name, None):
            router[name] = getattr(args, name)
    for name in ("open_health", "open_metrics"):
        if getattr(args, name, False):
            router[name] = True
    http_port = getattr(args, "http_port", None)
    if http_port is not None:
        router["http_port"] = None if http_port < 0 else http_port
    if router:
        updates["router"] = cfg.router.model_copy(update=router)
    engine = {k: getattr(args, k, None) for k in ("dtype", "max_model_len", "page_size", "num_pages", "max_num_seqs")}
    engine = {k: v for k, v in engine.items() if v is not None}
    tps = {role: _tp_of(args, role) for role in ("prefill", "decode", "colocated")}
    if engine or any(tps.values()):
        updates["pools"] = [p.model_copy(update={"engine": p.engine.model_copy(update={
            **engine, **({"tensor_parallel_size": tps[p.role]} if tps[p.role] is not None else {})})})
            for p in cfg.pools]
    if args.kv_transport:
        updates["transport"] = cfg.transport.model_copy(update={"kind": args.kv_transport})
    if getattr(args, "kv_store_size", None) is not None:
        updates["kv_store"] = {**cfg.kv_store.model_dump(), "size": args.kv_store_size}
    def dump(v):
        if isinstance(v, list):
            return [dump(x) for x in v]
        return v.model_dump() if hasattr(v, "model_dump") else v

    cfg = ClusterConfig.model_validate({**cfg.model_dump(), **{k: dump(v) for k, v in updates.items()}})
    if not args.config:  # the embedded default reserves this machine's CPUs for the ranks it starts
        cfg = with_machine_cpus(cfg)
    return cfg


def with_machine_cpus(cfg):
    """`cfg` with each rank of every pool reserving its share of this machine's CPUs (whole
    CPUs, at least 1 each): the embedded default's workers use the machine they run on."""
    from cluster.config import ClusterConfig, machine_share

    share = machine_share(sum((p.replicas + p.spare_replicas) * p.engine.tensor_parallel_size for p in cfg.pools))
    data = cfg.model_dump()
    for p in data["pools"]:
        p["resources"]["num_cpus"] = share
    return ClusterConfig.model_validate(data)


def _tp_of(args: argparse.Namespace, role: str) -> int | None:
    """The tensor-parallel size the flags give a pool of `role` (None: the config's)."""
    own = getattr(args, "prefill_tp" if role == "prefill" else "decode_tp", None)
    return own if own is not None else getattr(args, "tp", None)


def check_exposure(cfg, insecure: bool) -> None:
    """A router on a non-loopback address needs TLS and an API key, unless --insecure says so."""
    r = cfg.router
    try:
        loopback = ipaddress.ip_address(r.host).is_loopback
    except ValueError:
        loopback = r.host == "localhost"
    if loopback or insecure or (r.tls_cert and r.api_keys):
        return
    missing = [what for what, ok in (("TLS (--tls-cert/--tls-key)", r.tls_cert), ("an API key (--api-key)", r.api_keys))
               if not ok]
    raise ValueError(f"router.host {r.host!r} is reachable from other machines: serving it needs "
                     f"{' and '.join(missing)}, or --insecure to serve it without")


def config_errors(exc: Exception) -> str:
    """One line per problem, naming the field (pydantic's own text without its links)."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return f"  {exc}"
    lines = []
    for e in exc.errors():
        where = ".".join(str(x) for x in e["loc"]) or "config"
        value = e.get("input")
        shown = "" if isinstance(value, (dict, list)) or "api_keys" in where else f" (got {value!r})"  # no secrets
        lines.append(f"  {where}: {e['msg']}{shown}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from cluster.runtime import Cluster

    from pydantic import ValidationError

    try:
        cfg = load_config(args)
        check_exposure(cfg, getattr(args, "insecure", False))
        from cluster.config import check_model_fit

        check_model_fit(cfg)  # e.g. a tensor-parallel size that does not divide the model's heads
    except (ValidationError, ValueError, OSError) as exc:
        print(f"pdcluster serve: invalid configuration:\n{config_errors(exc)}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(*_) -> None:
        stop.set()

    def install() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    install()
    cluster = Cluster(cfg, address=args.address, on_event=lambda line: print(line, flush=True))
    pools = ", ".join(f"{p.name}: {p.replicas} x {p.role}" for p in cfg.pools)
    routers = f"{cfg.router.replicas} routers; " if cfg.router.replicas > 1 else ""
    print(f"starting pdcluster ({cfg.model}; {pools}; {routers}kv over {cfg.transport.kind})", flush=True)
    failed = ""
    try:
        address = cluster.start()
        install()  # ray.init installs its own SIGTERM handler (which exits at once): drain instead
        for r in cluster.routers:
            name = f" ({r.name})" if len(cluster.routers) > 1 else ""
            print(f"serving pdcluster.v1.Inference on {r.address}{name} (Ctrl-C to stop)", flush=True)
            if r.http_url:
                print(f"OpenAI-compatible API at {r.http_url}/v1{name}", flush=True)
            if r.metrics_url:
                print(f"metrics at {r.metrics_url}{name}", flush=True)
        if args.ready_file:
            Path(args.ready_file).write_text(address)
        while not stop.wait(0.5):
            if cluster.failure:
                failed = cluster.failure
                break
        print(f"pdcluster serve: {failed}; stopping" if failed else "draining...", file=sys.stderr if failed else
              sys.stdout, flush=True)
    finally:
        cluster.stop(args.grace)
    print("stopped", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace()))
