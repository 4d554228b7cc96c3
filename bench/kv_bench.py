"""`pdcluster bench kv`: KV transfer bandwidth between two processes, against baselines
measured in the same run (single-thread memcpy, one raw NIXL READ of one contiguous
buffer, a raw loopback TCP socket, a bare gRPC stream of 1 MiB bytes messages with no page
handling). Payload: Llama-3-8B-shaped KV (32 layers, 8 kv heads, head dim 128, bf16, page
16) for a 4,096-token prompt (~512 MiB). The receiver lives in this process, the sender in
a spawned child; figures are medians of `--repeats` after one untimed warm-up (each sample
is in `samples`); raw NIXL and paged nixl alternate sample for sample."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

TARGETS = {"nixl_vs_raw_nixl": 0.9, "grpc_vs_raw_tcp": 0.5, "layerwise_overlap": 1.15, "descriptor_setup_ms": 0.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="OUT", help="write the figures as JSON here")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096, ~512 MiB)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported")
    parser.add_argument("--only", default="", help="comma-separated subset of memcpy,raw_nixl,raw_tcp,raw_grpc,"
                                                   "nixl,grpc,layerwise (default: all)")
    parser.add_argument("--grpc-chunk-bytes", type=int, default=None, help="TransferConfig.chunk_bytes (grpc)")
    parser.add_argument("--grpc-inflight", type=int, default=None, help="TransferConfig.max_inflight_chunks (grpc)")


# ---- child process (sender side and raw baselines) ------------------------------------------
def _child(conn, spec_kw: dict, layout_kw: dict, num_pages: int) -> None:
    import os
    import socket

    import numpy as np
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # as TransferConfig does: UCX on loopback
    from kv_transfer.config import TransferConfig
    from kv_transfer.descriptor import DestinationDescriptor
    from kv_transfer.layout import KVLayout, KVPool, ModelSpec
    from kv_transfer.registry import create_sender

    pool = KVPool.allocate(ModelSpec(**spec_kw), KVLayout(**layout_kw), num_pages)
    for t in pool.layers:
        t.view(torch.int16).random_(-16000, 16000)
    senders, raw = {}, {}
    while True:
        cmd, *a = conn.recv()
        if cmd == "exit":
            break
        if cmd == "sender":
            senders[a[0]] = create_sender(a[0], pool, TransferConfig(**a[1]))
            conn.send(True)
        elif cmd == "start":
            transport, rid, desc, pages, tokens = a
            conn.send(senders[transport].start(rid, [DestinationDescriptor.from_bytes(desc)], pages, tokens).state.name)
        elif cmd == "send":
            transport, rid, compute_s = a
            s = senders[transport]
            computed = 0.0  # what the simulated compute really took: sleep overshoots on a busy box
            for layer in range(pool.layout.num_layers):
                if compute_s:
                    c0 = time.perf_counter()
                    time.sleep(compute_s)  # simulated compute of this layer (releases the GIL, as torch does)
                    computed += time.perf_counter() - c0
                s.send_layer(rid, layer)
            s.finish(rid, 1, 0)
            conn.send((s.wait(rid, 300).state.name, computed))
        elif cmd == "raw_nixl":
            from kv_transfer.nixl_pool import nixl_api

            api = nixl_api()
            buf = torch.empty(a[0], dtype=torch.uint8)
            buf.random_()
            # the source needs progress for UCX wire-up while this loop waits on the pipe
            agent = api.nixl_agent("bench-raw-src", api.nixl_agent_config(enable_prog_thread=True))
            agent.register_memory(buf)
            raw["nixl"] = (agent, buf)
            conn.send((agent.get_agent_metadata(), buf.data_ptr(), a[0]))
        elif cmd == "raw_grpc":
            import grpc

            port, nbytes, msg_bytes, repeats = a
            payload = np.ones(msg_bytes, dtype=np.uint8).tobytes()
            opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as channel:
                push = channel.stream_unary("/bench.RawBytes/Push")  # bytes in, bytes out: no protobuf
                for _ in range(repeats):
                    push(iter([payload] * (nbytes // msg_bytes)), timeout=300)
            conn.send(True)
        elif cmd == "raw_tcp":
            port, nbytes, repeats = a
            payload = np.ones(nbytes, dtype=np.uint8)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                for _ in range(repeats):
                    sock.sendall(memoryview(payload))
            conn.send(True)
    for s in senders.values():
        s.close()
    conn.send("bye")


# ---- baselines measured here ------------------------------------------------------------------
def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _memcpy_s(nbytes: int, repeats: int) -> list[float]:
    import torch

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - t0)
    return out


def _raw_nixl(conn, nbytes: int):
    """One raw NIXL READ of one contiguous buffer from the child: returns a callable timing one."""
    import numpy as np
    import torch

    from kv_transfer.nixl_pool import nixl_api

    api = nixl_api()
    conn.send(("raw_nixl", nbytes))
    md, addr, _ = conn.recv()
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # lazily zeroed, like the pool: the warm-up faults it in
    agent = api.nixl_agent("bench-raw-dst", api.nixl_agent_config(enable_prog_thread=False))
    agent.register_memory(dst)
    name = agent.add_remote_agent(md)
    name = name.decode() if isinstance(name, bytes) else name
    local = agent.get_xfer_descs(np.array([[dst.data_ptr(), nbytes, 0]], dtype=np.uint64), "DRAM")
    remote = agent.get_xfer_descs(np.array([[addr, nbytes, 0]], dtype=np.uint64), "DRAM")

    def once() -> float:
        handle = agent.initialize_xfer("READ", local, remote, name)
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        assert state == "DONE", state
        agent.release_xfer_handle(handle)
        return elapsed

    once.keep = (agent, dst)  # alive as long as the callable
    return once


def _raw_grpc_s(conn, nbytes: int, repeats: int, msg_bytes: int = 1 << 20) -> list[float]:
    """A bare gRPC client stream of `msg_bytes` bytes messages (identity serializers, no page
    handling), timed here from the first message to the last: what Python gRPC itself costs."""
    from concurrent import futures

    import grpc

    out: list[float] = []

    def push(messages, context):
        t0, got = None, 0
        for m in messages:
            t0 = t0 or time.perf_counter()
            got += len(m)
        out.append(time.perf_counter() - t0)
        return b""

    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=opts)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.RawBytes", {"Push": grpc.stream_unary_rpc_method_handler(push)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        conn.send(("raw_grpc", port, nbytes, msg_bytes, repeats + 1))  # the first is a warm-up
        conn.recv()
    finally:
        server.stop(0)
    return out[1:]


def _raw_tcp_s(conn, nbytes: int, repeats: int) -> list[float]:
    import socket

    import numpy as np

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        conn.send(("raw_tcp", server.getsockname()[1], nbytes, repeats + 1))  # the first is a warm-up
        sock, _ = server.accept()
        buf = memoryview(np.empty(nbytes, dtype=np.uint8))
        out = []
        with sock:
            for _ in range(repeats + 1):
                got, t0 = 0, None
                while got < nbytes:
                    n = sock.recv_into(buf[got:], min(8 << 20, nbytes - got))
                    t0 = t0 or time.perf_counter()  # timed from the first byte
                    got += n
                out.append(time.perf_counter() - t0)
    conn.recv()
    return out[1:]


def _paged(conn, transport: str, pool, tokens: int, repeats: int, compute_s: float = 0.0,
           config_kw: dict | None = None, baseline=None) -> tuple[list, list, list]:
    """Seconds per repeat from the sender's first layer to DONE here, (nixl) each request's
    descriptor set-up seconds, and the `baseline()` samples taken just before each repeat (so
    both see the same background load; with `compute_s`, the baseline samples are the seconds
    the sender's simulated compute really took). One untimed warm-up first faults the pages in."""
    from kv_transfer.config import TransferConfig
    from kv_transfer.registry import create_receiver

    config_kw = config_kw or {}
    recv = create_receiver(transport, pool, TransferConfig(**config_kw))
    conn.send(("sender", transport, config_kw))
    conn.recv()
    pages = list(range(pool.layout.pages_for(tokens)))
    times, rids, base = [], [], []
    try:
        for i in range(-1, repeats):
            if baseline is not None:
                b = baseline()
                if i >= 0:
                    base.append(b)
            rid = f"{transport}-{compute_s}-{i}"
            desc = recv.expect(rid, pages, tokens, deadline_s=300)
            conn.send(("start", transport, rid, desc.to_bytes(), pages, tokens))
            assert conn.recv() == "WAITING"
            t0 = time.perf_counter()
            conn.send(("send", transport, rid, compute_s))
            status = recv.wait(rid, 300)
            elapsed = time.perf_counter() - t0
            assert status.state.name == "DONE", status.error
            sender_state, computed = conn.recv()
            assert sender_state == "DONE"
            recv.take(rid)
            if i >= 0 and compute_s:
                base.append(computed)
            if i >= 0:
                rids.append(rid)
                times.append(elapsed)
        setup = [(recv.setup_s[r], recv.setup_wall_s[r]) for r in rids] if transport == "nixl" else []
    finally:
        recv.close()
    return times, setup, base


def measure_transfer(transport: str, spec_kw: dict, layout_kw: dict, token_sizes, repeats: int = 3,
                     config_kw: dict | None = None) -> list[tuple[int, int, list[float]]]:
    """Paged KV transfers of each size in `token_sizes` from a spawned sender process to a
    receiver here, over one receiver/sender pair: (tokens, payload bytes, seconds per repeat)
    per size, each timed from the sender's first layer to DONE here, after one untimed warm-up
    of the largest size (faults every page in) and one of each size."""
    import multiprocessing as mp
    import os

    from kv_transfer.layout import KVLayout, KVPool, ModelSpec

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    layout = KVLayout(**layout_kw)
    num_pages = layout.pages_for(max(token_sizes))
    pool = KVPool.allocate(ModelSpec(**spec_kw), layout, num_pages)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_child, args=(child_conn, spec_kw, layout_kw, num_pages), daemon=True)
    child.start()
    out = []
    try:
        from kv_transfer.config import TransferConfig
        from kv_transfer.registry import create_receiver

        config_kw = config_kw or {}
        recv = create_receiver(transport, pool, TransferConfig(**config_kw))
        try:
            conn.send(("sender", transport, config_kw))
            conn.recv()
            sizes = [max(token_sizes), *token_sizes]
            for k, tokens in enumerate(sizes):
                pages = list(range(layout.pages_for(tokens)))
                times = []
                for i in range(-1 if k else 0, repeats if k else 0):
                    rid = f"measure-{transport}-{k}-{i}"
                    desc = recv.expect(rid, pages, tokens, deadline_s=300)
                    conn.send(("start", transport, rid, desc.to_bytes(), pages, tokens))
                    assert conn.recv() == "WAITING"
                    t0 = time.perf_counter()
                    conn.send(("send", transport, rid, 0.0))
                    status = recv.wait(rid, 300)
                    elapsed = time.perf_counter() - t0
                    assert status.state.name == "DONE", status.error
                    assert conn.recv()[0] == "DONE"
                    recv.take(rid)
                    if i >= 0:
                        times.append(elapsed)
                if k:
                    out.append((tokens, len(pages) * layout.page_bytes * layout.num_layers, times))
        finally:
            recv.close()
        conn.send(("exit",))
        conn.recv()
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    return out


def run(args: argparse.Namespace) -> int:
    import multiprocessing as mp
    import os

    import torch

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
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_child, args=(child_conn, spec_kw, layout_kw, num_pages), daemon=True)
    child.start()
    r = max(1, args.repeats)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    want = (lambda name: not only or name in only)  # noqa: E731
    samples: dict[str, list[float]] = {}
    try:
        res: dict = {"tokens": args.tokens, "payload_bytes": nbytes, "layers": args.layers, "repeats": r}
        # baselines and ours interleaved in one run, so background load hits them alike
        if want("memcpy"):
            samples["memcpy_s"] = _memcpy_s(nbytes, r)
            res["memcpy_gbps"] = _gbps(nbytes, samples["memcpy_s"])
        if want("nixl") or want("layerwise") or want("raw_nixl"):
            # raw NIXL and paged nixl alternate, sample for sample
            raw = _raw_nixl(conn, nbytes) if want("raw_nixl") else None
            samples["nixl_s"], setup, raw_s = _paged(conn, "nixl", pool, args.tokens, r, baseline=raw)
            res["nixl_gbps"] = _gbps(nbytes, samples["nixl_s"])
            if raw is not None:
                samples["raw_nixl_s"] = raw_s
                res["raw_nixl_gbps"] = _gbps(nbytes, raw_s)
            samples["descriptor_setup_s"] = [cpu for cpu, _ in setup]
            samples["descriptor_setup_wall_s"] = [wall for _, wall in setup]
            # set-up work of one request (its receiver thread's CPU time over all its layers'
            # index arrays and prepared transfers); the wall figure also holds GIL waits and
            # preemption by whatever else runs on the machine
            res["descriptor_setup_ms"] = statistics.median(samples["descriptor_setup_s"]) * 1e3
            res["descriptor_setup_wall_ms"] = statistics.median(samples["descriptor_setup_wall_s"]) * 1e3
        if want("raw_tcp"):
            samples["raw_tcp_s"] = _raw_tcp_s(conn, nbytes, r)
            res["raw_tcp_gbps"] = _gbps(nbytes, samples["raw_tcp_s"])
        if want("raw_grpc"):
            samples["raw_grpc_s"] = _raw_grpc_s(conn, nbytes, r)
            res["raw_grpc_gbps"] = _gbps(nbytes, samples["raw_grpc_s"])
        if want("grpc"):
            grpc_kw = {k: v for k, v in (("chunk_bytes", args.grpc_chunk_bytes),
                                         ("max_inflight_chunks", args.grpc_inflight)) if v is not None}
            if grpc_kw:
                res["grpc_config"] = grpc_kw
            samples["grpc_s"], _, _ = _paged(conn, "grpc", pool, args.tokens, r, config_kw=grpc_kw)
            res["grpc_gbps"] = _gbps(nbytes, samples["grpc_s"])
        if want("layerwise"):
            layer_s = statistics.median(samples["nixl_s"]) / args.layers  # one layer's transfer time
            e2e_s, _, computed_s = _paged(conn, "nixl", pool, args.tokens, r, compute_s=layer_s)
            samples["layerwise_e2e_s"], samples["layerwise_compute_s"] = e2e_s, computed_s
            res["layer_transfer_ms"] = layer_s * 1e3
            res["layerwise_e2e_ms"] = statistics.median(e2e_s) * 1e3
            res["layerwise_compute_ms"] = statistics.median(computed_s) * 1e3
            # Against the compute the sender really did (a sleep overshoots under load), plus one
            # layer's transfer: 1.0 means the transfer hid completely behind compute.
            res["layerwise_overlap"] = statistics.median(e / (c + layer_s) for e, c in zip(e2e_s, computed_s))
        for key, num, den in (("nixl_vs_raw_nixl", "nixl_gbps", "raw_nixl_gbps"),
                              ("grpc_vs_raw_tcp", "grpc_gbps", "raw_tcp_gbps"),
                              ("grpc_vs_raw_grpc", "grpc_gbps", "raw_grpc_gbps"),
                              ("raw_grpc_vs_raw_tcp", "raw_grpc_gbps", "raw_tcp_gbps"),
                              ("nixl_vs_memcpy", "nixl_gbps", "memcpy_gbps")):
            if num in res and den in res:
                res[key] = res[num] / res[den]
        res["targets"] = TARGETS
        res["samples"] = samples
        conn.send(("exit",))
        conn.recv()
        raw_agent = None  # noqa: F841
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    _print(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _print(res: dict) -> None:
    print(f"KV transfer, {res['tokens']} tokens, {res['layers']} layers, {res['payload_bytes'] / 2**20:.0f} MiB, "
          f"medians of {res['repeats']}")
    rows = [(key, "GB/s", "") for key in ("memcpy_gbps", "raw_nixl_gbps", "raw_tcp_gbps", "raw_grpc_gbps",
                                          "nixl_gbps", "grpc_gbps")]
    rows += [("descriptor_setup_ms", "ms", "(target <= 0.5)"), ("descriptor_setup_wall_ms", "ms", ""), ("layer_transfer_ms", "ms", ""),
             ("layerwise_e2e_ms", "ms", ""), ("layerwise_overlap", "", "(target <= 1.15)"),
             ("nixl_vs_raw_nixl", "", "(target >= 0.9)"), ("grpc_vs_raw_tcp", "", "(target >= 0.5)"),
             ("grpc_vs_raw_grpc", "", ""), ("raw_grpc_vs_raw_tcp", "", ""), ("nixl_vs_memcpy", "", "")]
    for key, unit, note in rows:
        if res.get(key) is not None:
            print(f"  {key:<22}{res[key]:>10.3f} {unit:<5}{note}")


if __name__ == "__main__":
    from cluster.cli import main

    sys.exit(main(["bench", "kv", *sys.argv[1:]]))
