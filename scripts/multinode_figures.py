#!/usr/bin/env python3
"""Figures of issue 30 item 4, across namespaced hosts (needs root; scripts/netns_cluster.py).

    scripts/multinode_figures.py kv    [--tokens 4096 --rounds 3 --json OUT]
    scripts/multinode_figures.py serve [--num-requests 50 --transport nixl --json OUT]

kv: `pdcluster bench kv` runs its sender in a spawned child over 127.0.0.1 and cannot be pointed
at another host, so this does the same measurement with the project's real transports
(kv_transfer.registry.create_sender/create_receiver): the receiver in one process inside the
decode host's namespace (10.77.0.3), the sender in one process inside the prefill host's
(10.77.0.2), UCX told to use TCP only on eth0 (the veth). Baseline, in the same rounds: one raw
TCP connection between the same two processes, sending the same number of bytes. Every round
times each figure once, in turns (a burst of load hits a figure and its baseline alike); each
sample is from "send" posted to the sender until the receiver reports DONE (raw TCP: all bytes
received). The same is repeated with both processes in one namespace over 127.0.0.1 ("one
host": UCX TCP on lo, raw TCP on lo), so the cost of the veth shows too. Payload: Llama-3-8B
shaped KV (32 layers, 8 kv heads, head dim 128, bf16, page 16) of --tokens tokens.

serve: `pdcluster bench serve` against the built-in tiny model (float32) on (a) the 3-host Ray
cluster (prefill pool pinned to the prefill host, decode pool to the decode host, router on the
head, UCX_TLS=tcp), the benchmark client in the head's namespace, and (b) one local cluster
(`pdcluster serve --config` with the same pools minus the pinning, `--port 0`, 127.0.0.1), same
engine settings and same seeded workload.

Everything made here (namespaces pdfkv-*, pdfig-*, their processes) is removed at the end, also on
failure.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from netns_cluster import VENV_BIN, NetnsCluster  # noqa: E402

PY = str(VENV_BIN / "python")


# ------------------------------------------------------------------------------------ peer --
class Peer:
    """Runs inside a namespace; JSON lines on stdin, one reply line each on stdout."""

    def __init__(self) -> None:
        self.pool = None
        self.objs: dict = {}
        self.lsock = self.csock = self.payload = None

    def cmd_init(self, spec, layout, num_pages):
        import torch

        from kv_transfer.layout import KVLayout, KVPool, ModelSpec

        torch.set_num_threads(1)
        self.pool = KVPool.allocate(ModelSpec(**spec), KVLayout(**layout), num_pages)
        for t in self.pool.layers:
            t.view(torch.int16).random_(-16000, 16000)
        return {}

    def cmd_receiver(self, name, transport, cfg):
        from kv_transfer.config import TransferConfig
        from kv_transfer.registry import create_receiver

        self.objs[name] = create_receiver(transport, self.pool, TransferConfig(**cfg))
        return {"endpoint": self.objs[name].endpoint}

    def cmd_sender(self, name, transport, cfg):
        from kv_transfer.config import TransferConfig
        from kv_transfer.registry import create_sender

        self.objs[name] = create_sender(transport, self.pool, TransferConfig(**cfg))
        return {}

    def cmd_expect(self, name, rid, pages, tokens):
        d = self.objs[name].expect(rid, pages, tokens, deadline_s=300)
        return {"desc": base64.b64encode(d.to_bytes()).decode()}

    def cmd_start(self, name, rid, desc, pages, tokens):
        from kv_transfer.descriptor import DestinationDescriptor

        st = self.objs[name].start(rid, [DestinationDescriptor.from_bytes(base64.b64decode(desc))], pages, tokens)
        return {"state": st.state.name}

    def cmd_send(self, name, rid):
        s = self.objs[name]
        for layer in range(self.pool.layout.num_layers):
            s.send_layer(rid, layer)
        s.finish(rid, 1, 0)
        st = s.wait(rid, 300)
        return {"state": st.state.name, "error": st.error}

    def cmd_wait(self, name, rid):
        st = self.objs[name].wait(rid, 300)
        t = time.perf_counter()
        self.objs[name].take(rid)
        return {"state": st.state.name, "error": st.error, "t_done": t}

    def cmd_tcp_listen(self, host):
        self.lsock = socket.create_server((host, 0))
        return {"port": self.lsock.getsockname()[1]}

    def cmd_tcp_recv(self, nbytes):
        if self.csock is None:
            self.csock, _ = self.lsock.accept()
            self.payload = bytearray(4 << 20)
        mv, left = memoryview(self.payload), nbytes
        while left:
            n = self.csock.recv_into(mv, min(left, len(mv)))
            if not n:
                raise RuntimeError("raw tcp: peer closed")
            left -= n
        return {}

    def cmd_tcp_send(self, host, port, nbytes):
        import numpy as np

        if self.csock is None:
            self.csock = socket.create_connection((host, port))
            self.payload = np.ones(nbytes, dtype=np.uint8)
        self.csock.sendall(memoryview(self.payload)[:nbytes])
        return {}

    def cmd_close(self, name):
        self.objs.pop(name).close()
        return {}


def peer_main() -> int:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever libraries print goes to stderr
    peer = Peer()
    print(json.dumps({"ok": True}), file=replies, flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            reply = getattr(peer, "cmd_" + msg.pop("cmd"))(**msg)
            reply["ok"] = True
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), file=replies, flush=True)
    for o in list(peer.objs.values()):
        o.close()
    return 0


class PeerProc:
    def __init__(self, ns: str | None, env: dict, log: Path) -> None:
        argv = [PY, str(Path(__file__).resolve()), "_peer"]
        if ns:
            argv = ["ip", "netns", "exec", ns, *argv]
        self.errf = open(log, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errf, text=True,
                                     env=env, cwd=REPO, start_new_session=True)
        self.log = log
        self.pending = 0
        self.read(120)

    def read(self, timeout=600.0) -> dict:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            raise TimeoutError(f"peer: no reply in {timeout}s; log {self.log}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited; log {self.log}: {self.log.read_text()[-2000:]}")
        msg = json.loads(line)
        if not msg.pop("ok"):
            raise RuntimeError(f"peer: {msg['error']}")
        return msg

    def post(self, cmd, **kw) -> None:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()

    def call(self, cmd, timeout=600.0, **kw) -> dict:
        self.post(cmd, **kw)
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(30)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.errf.close()


# -------------------------------------------------------------------------------------- kv --
# UCX and poll settings of nixl compared in one run (`--variants`): each variant runs nixl in its own
# processes (UCX reads its environment once), all variants sampled in the same rounds.
#   before:    as the cluster ran until issue 35: UCX's own TCP fragments (8 KiB tx, 64 KiB rx), the
#              sender polled every 2 ms, pollers backing off to 4 ms
#   now:       the cluster's defaults (kv_transfer/nixl_pool.py UCX_ENV_DEFAULTS: 512 KiB fragments;
#              TransferConfig: sender poll 0.5 ms, back-off to 1 ms)
#   seg_only:  `before` with the 512 KiB fragments alone; poll_only: `before` with the polls alone
_OLD_SEG = {"UCX_TCP_TX_SEG_SIZE": "8k", "UCX_TCP_RX_SEG_SIZE": "64k"}
_OLD_POLL = {"nixl_sender_poll_s": 0.002, "poll_backoff_max_s": 0.004}
VARIANTS: dict[str, tuple[dict, dict]] = {
    "before": (_OLD_SEG, _OLD_POLL),
    "now": ({}, {}),
    "seg_only": ({}, _OLD_POLL),
    "poll_only": (_OLD_SEG, {}),
}


def kv_placement(label, rx_ns, tx_ns, rx_ip, tx_ip, dev, tls, args, spec, layout_kw, num_pages, nbytes, logdir):
    """Rounds of raw TCP / nixl (each UCX variant) / grpc between a receiver and a sender process,
    and with --tp21 nixl from two sender ranks (heads [0, 4) and [4, 8), both on the sender's
    host, each its own process and NIXL agent) to one receiver holding all 8 heads (routes from
    kv_transfer.reshard.plan_transfer); seconds per sample, keyed by figure."""
    from kv_transfer.layout import KVLayout
    from kv_transfer.reshard import group_layouts, plan_transfer

    layout = KVLayout(**layout_kw)
    base = {k: os.environ[k] for k in ("HOME", "LANG", "PDCLUSTER_CACHE", "TMPDIR") if k in os.environ}
    env = {**base, "PATH": f"{VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1",
           **{k: v for k, v in os.environ.items() if k.startswith("UCX_")},  # e.g. UCX_PROTO_INFO=y
           "UCX_NET_DEVICES": dev}
    if tls:
        env["UCX_TLS"] = tls
    else:
        env.pop("UCX_TLS", None)  # UCX picks (one host: shared memory / CMA), as `bench kv` runs
    variants = [v for v in args.variants.split(",") if v]
    lay_kw = {k: layout_kw[k] for k in ("num_layers", "page_size", "head_dim", "dtype")}
    halves = group_layouts(spec["num_kv_heads"], 2, **lay_kw)
    plan = plan_transfer(halves, [layout])
    procs: list[PeerProc] = []
    peers: dict = {}  # variant -> (rx, tx, [tx rank 0, tx rank 1])

    def peer(ns, venv, log, lay):
        p = PeerProc(ns, venv, log)
        procs.append(p)
        p.call("init", spec=spec, layout=lay, num_pages=num_pages)
        return p

    samples: dict[str, list[float]] = {}
    try:
        for i, v in enumerate(variants):
            venv_, cfg = VARIANTS[v]
            venv = {**env, **venv_}
            rx = peer(rx_ns, venv, logdir / f"{label}-{v}-rx.log", layout_kw)
            tx = peer(tx_ns, venv, logdir / f"{label}-{v}-tx.log", layout_kw)
            tps = []
            if args.tp21:
                for r, half in enumerate(halves):
                    tps.append(peer(tx_ns, venv, logdir / f"{label}-{v}-tx{r}.log",
                                    {**layout_kw, "head_start": half.head_start, "num_heads": half.num_heads}))
            transports = ["nixl"] + (["grpc"] if i == 0 and "grpc" in args.only else [])
            for t in transports:
                rx.call("receiver", name=t, transport=t, cfg=dict(host=rx_ip, ucx_net_devices=dev, **cfg))
                for p in [tx] + (tps if t == "nixl" else []):
                    p.call("sender", name=t, transport=t, cfg=dict(host=tx_ip, ucx_net_devices=dev, **cfg))
            peers[v] = (rx, tx, tps, transports)
        rx0, tx0 = peers[variants[0]][:2]
        port = rx0.call("tcp_listen", host=rx_ip)["port"]
        pages = list(range(layout.pages_for(args.tokens)))
        n = [0]

        def paged(t, rx, senders):
            rid = f"{t}-{n[0]}"
            n[0] += 1
            desc = rx.call("expect", name=t, rid=rid, pages=pages, tokens=args.tokens)["desc"]
            for s in senders:
                st = s.call("start", name=t, rid=rid, desc=desc, pages=pages, tokens=args.tokens)["state"]
                if st != "WAITING":
                    raise RuntimeError(f"{t} start: {st}")
            rx.post("wait", name=t, rid=rid)
            time.sleep(0.05)  # the receiver is in wait() before the first byte is sent
            t0 = time.perf_counter()
            for s in senders:
                s.post("send", name=t, rid=rid)
            r = rx.read()
            dt = time.perf_counter() - t0
            for s in senders:
                st = s.read()
                if st["state"] != "DONE":
                    raise RuntimeError(f"{t}: sender {st}")
            if r["state"] != "DONE":
                raise RuntimeError(f"{t}: receiver {r}")
            return dt

        def raw():
            rx0.post("tcp_recv", nbytes=nbytes)
            time.sleep(0.05)
            t0 = time.perf_counter()
            tx0.post("tcp_send", host=rx_ip, port=port, nbytes=nbytes)
            rx0.read()
            dt = time.perf_counter() - t0
            tx0.read()
            return dt

        figs = [("raw_tcp", raw)]
        for v, (rx, tx, tps, transports) in peers.items():
            tag = "" if len(variants) == 1 else f"[{v}]"
            figs.append((f"nixl{tag}", lambda rx=rx, tx=tx: paged("nixl", rx, [tx])))
            if tps:
                assert len(plan.routes) == 2 and {r.sender for r in plan.routes} == {0, 1}
                figs.append((f"nixl_tp2to1{tag}", lambda rx=rx, tps=tps: paged("nixl", rx, tps)))
            if "grpc" in transports:
                figs.append(("grpc", lambda rx=rx, tx=tx: paged("grpc", rx, [tx])))
        for _, f in figs:  # warm-up round: connections, UCX wire-up, page faults
            f()
        for i in range(args.rounds):
            for name, f in (figs if i % 2 == 0 else figs[::-1]):
                samples.setdefault(name, []).append(f())
            print(f"  [{label}] round {i + 1}: " + ", ".join(
                f"{k} {nbytes / samples[k][-1] / 1e9:.2f}" for k, _ in figs) + " GB/s", flush=True)
    finally:
        for p in procs[::-1]:
            p.close()
    return samples


def cmd_kv(args) -> int:
    from kv_transfer.layout import KVLayout

    args.only = set(args.only.split(","))
    spec = dict(model_id="llama-3-8b-shape", num_layers=32, num_kv_heads=8, head_dim=128)
    layout_kw = dict(num_layers=32, page_size=16, head_start=0, num_heads=8, head_dim=128, dtype="bfloat16")
    layout = KVLayout(**layout_kw)
    num_pages = layout.pages_for(args.tokens)
    nbytes = num_pages * layout.page_bytes * layout.num_layers
    print(f"payload: {args.tokens} tokens, {nbytes / 2**20:.0f} MiB, Llama-3-8B-shaped bf16 KV", flush=True)
    c = NetnsCluster(prefix="pdfkv", workdir=Path(tempfile.mkdtemp(prefix="pdkv-")))
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="pdkv-logs-"))
    logdir.mkdir(parents=True, exist_ok=True)
    c.down()
    out = {"tokens": args.tokens, "bytes": nbytes, "rounds": args.rounds, "placements": {}}
    try:
        c.up_network()
        rx_ip, tx_ip = c.host("decode").ip, c.host("prefill").ip
        places = [("cross", c.ns("decode"), c.ns("prefill"), rx_ip, tx_ip, "eth0", "tcp")]
        if not args.no_local:
            places.append(("local", c.ns("decode"), c.ns("decode"), "127.0.0.1", "127.0.0.1", "lo", "tcp"))
        if args.local_default:
            places.append(("local-default", c.ns("decode"), c.ns("decode"), "127.0.0.1", "127.0.0.1", "lo", ""))
        for label, rxn, txn, rip, tip, dev, tls in places:
            out["placements"][label] = kv_placement(label, rxn, txn, rip, tip, dev, tls, args, spec, layout_kw,
                                                    num_pages, nbytes, logdir)
    finally:
        c.down()
        assert not c.existing_namespaces()
    print()
    print(f"| placement | figure | GB/s (median of {args.rounds}) | vs raw TCP same placement (median of per-round ratios) |")
    print("|---|---|---|---|")
    for label, s in out["placements"].items():
        for name, xs in s.items():
            gbps = statistics.median(nbytes / x / 1e9 for x in xs)
            ratio = statistics.median(b / x for b, x in zip(s["raw_tcp"], xs))
            out.setdefault("table", []).append(dict(placement=label, figure=name, gbps=gbps, vs_raw_tcp=ratio))
            print(f"| {label} | {name} | {gbps:.2f} | {ratio:.2f} |")
    for label, s in out["placements"].items():
        for name in s:
            if name.startswith("nixl_tp2to1"):
                one = "nixl" + name[len("nixl_tp2to1"):]
                ratio = statistics.median(b / x for b, x in zip(s[one], s[name]))
                out.setdefault("tp2to1_vs_1to1", {})[f"{label} {name}"] = ratio
                print(f"{label} {name} / {one} (same rounds, median of per-round ratios): {ratio:.2f}")
    if "local" in out["placements"]:
        for name in out["placements"]["cross"]:
            if name not in out["placements"]["local"]:
                continue
            xs, ys = out["placements"]["cross"][name], out["placements"]["local"][name]
            print(f"cross-host / one-host throughput, {name}: {statistics.median(ys) / statistics.median(xs):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


# ----------------------------------------------------------------------------------- serve --
ENGINE = dict(num_pages=256, max_model_len=256, max_num_batched_tokens=512, max_num_seqs=32, page_size=16)


def bench_argv(args, address: str, out: Path) -> list[str]:
    return [str(VENV_BIN / "pdcluster"), "bench", "serve", "--address", address, "--dataset", "random",
            "--num-requests", str(args.num_requests), "--request-rate", str(args.request_rate),
            "--random-input-len", args.input_len, "--random-output-len", args.output_len, "--seed", "7",
            "--percentiles", "50,90", "--no-progress", "--json", str(out)]


def wait_log(proc, log: Path, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while needle not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"serve not ready in {timeout}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop(proc) -> None:
    """SIGTERM to serve alone (it drains, stops its workers and, for a local cluster, its Ray),
    then SIGKILL to whatever is left of its process group."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass


def config(transport: str, host: str, pinned: bool) -> dict:
    pools = []
    for role, node in (("prefill", "node_prefill"), ("decode", "node_decode")):
        res = dict(num_cpus=1, custom={node: 1}) if pinned else dict(num_cpus=1)
        pools.append(dict(name=role, role=role, replicas=1, resources=res, engine=ENGINE))
    router = dict(host=host, port=50051, num_cpus=1) if pinned else dict(host=host, port=50051)
    return dict(model="tiny", transport=dict(kind=transport), router=router, pools=pools)


def serve_multi(args, work: Path) -> dict:
    from engine.builtin import ensure_builtin

    ensure_builtin(arch="llama", preset="tiny")
    c = NetnsCluster(prefix="pdfig", workdir=Path(tempfile.mkdtemp(prefix="pdfig-")), env={"UCX_TLS": "tcp"})
    c.down()
    try:
        c.up()
        head = c.host("head").ip
        cfg = work / "multi.yaml"
        cfg.write_text(json.dumps(config(args.transport, head, pinned=True)))
        log = work / "serve-multi.log"
        with open(log, "w") as f:
            proc = c.popen("head", [str(VENV_BIN / "pdcluster"), "serve", "--address", c.head_address, "--config",
                                    str(cfg), "--insecure", "--http-port", "-1", "--metrics-port", "-1"],
                           env={"UCX_TLS": "tcp"}, stdout=f, stderr=subprocess.STDOUT)
            try:
                wait_log(proc, log, "serving pdcluster.v1.Inference on", 300)
                out = work / "bench-multi.json"
                argv = bench_argv(args, f"{head}:50051", out)
                print("  [multi] " + " ".join(["ip netns exec pdfig-head", *argv]), flush=True)
                r = c.run("head", argv, timeout=900, check=False)
                print(r.stdout[-3000:], r.stderr[-2000:], flush=True)
                if r.returncode:
                    raise RuntimeError(f"bench serve (multi) failed {r.returncode}")
                return json.loads(out.read_text())
            finally:
                stop(proc)
    finally:
        c.down()
        assert not c.existing_namespaces()


def serve_local(args, work: Path) -> dict:
    cfg = work / "local.yaml"
    cfg.write_text(json.dumps(config(args.transport, "127.0.0.1", pinned=False)))
    ready = work / "ready"
    log = work / "serve-local.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen([str(VENV_BIN / "pdcluster"), "serve", "--config", str(cfg), "--port", "0",
                                 "--insecure", "--http-port", "-1", "--metrics-port", "-1", "--ready-file", str(ready)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            wait_log(proc, log, "serving pdcluster.v1.Inference on", 300)
            out = work / "bench-local.json"
            argv = bench_argv(args, ready.read_text().strip(), out)
            print("  [local] " + " ".join(argv), flush=True)
            r = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
            print(r.stdout[-3000:], r.stderr[-2000:], flush=True)
            if r.returncode:
                raise RuntimeError(f"bench serve (local) failed {r.returncode}")
            return json.loads(out.read_text())
        finally:
            stop(proc)


def cmd_serve(args) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pdmn-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work dir {work}", flush=True)
    res = {}
    for which in args.order.split(","):
        res[which] = (serve_multi if which == "multi" else serve_local)(args, work)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: summary(v) for k, v in res.items()}, indent=1))
    return 0


def summary(d: dict) -> dict:
    """The figures of one bench serve JSON (keys vary; keep the latency percentiles and rates)."""
    d = d.get("summary", d)
    keep = {}
    for k, v in d.items():
        if isinstance(v, (int, float)) and any(s in k for s in ("ttft", "tpot", "itl", "e2e", "throughput",
                                                                  "completed", "failed", "duration")):
            keep[k] = v
    return keep or {k: v for k, v in d.items() if not isinstance(v, (list, dict))}


def main() -> int:
    if sys.argv[1:2] == ["_peer"]:
        return peer_main()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kv")
    k.add_argument("--tokens", type=int, default=4096)
    k.add_argument("--rounds", type=int, default=3)
    k.add_argument("--only", default="nixl,grpc")
    k.add_argument("--no-local", action="store_true", help="skip the one-namespace (127.0.0.1) placement")
    k.add_argument("--local-default", action="store_true",
                   help="also both processes in one namespace with UCX's own transport choice (no UCX_TLS)")
    k.add_argument("--variants", default="now",
                   help=f"UCX settings of nixl compared in the same rounds, comma-separated, of {sorted(VARIANTS)} "
                        "(default now: the cluster's; e.g. before,now)")
    k.add_argument("--tp21", action="store_true",
                   help="also P_TP=2 -> D_TP=1: two sender ranks on the prefill host, one receiver on the decode host")
    k.add_argument("--logdir")
    k.add_argument("--json")
    s = sub.add_parser("serve")
    s.add_argument("--transport", default="nixl", choices=["nixl", "grpc"])
    s.add_argument("--num-requests", type=int, default=50)
    s.add_argument("--request-rate", default="1")
    s.add_argument("--input-len", default="64:192")
    s.add_argument("--output-len", default="16:48")
    s.add_argument("--order", default="multi,local")
    s.add_argument("--workdir")
    s.add_argument("--json")
    args = p.parse_args()
    return cmd_kv(args) if args.cmd == "kv" else cmd_serve(args)


if __name__ == "__main__":
    sys.exit(main())
