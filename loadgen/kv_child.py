"""The sending process of `pdcluster bench kv`: it holds the sender's KV pool and the sending
side of every baseline, and obeys commands from the measuring process over a pipe (test
control only; the transfers themselves are the real transports). It is a separate process
so that sender and receiver compete for the CPU as two real workers would.

Commands, one reply each:
  ("sender", name, transport, config_kw)               create sender `name` for `transport`
  ("start", name, rid, descriptor, pages, tokens)      handshake + begin; replies the state name
  ("send", name, rid, compute_s)                       every layer (after `compute_s` of simulated
                                                       compute each), then finish; replies
                                                       (final state name, seconds really computed)
  ("raw_nixl", nbytes)                                 register one contiguous buffer; replies
                                                       (agent metadata, address, nbytes)
  ("raw_tcp", port, nbytes)                            send nbytes on one kept-open connection
  ("raw_grpc", port, nbytes, msg_bytes, streams)       one bare gRPC client stream per channel
                                                       (`streams` channels, kept open), nbytes in all
  ("exit",)
"""
from __future__ import annotations

import os
import socket
import threading
import time


def grpc_options(streams: int) -> list[tuple[str, int]]:
    """Channel options of the raw gRPC baseline: the transport's message limits, and (as the
    transport's data lanes do) one connection per channel."""
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    return opts + [("grpc.use_local_subchannel_pool", 1)] if streams > 1 else opts


def child_main(conn, spec_kw: dict, layout_kw: dict, num_pages: int) -> None:
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
    senders, keep = {}, {}
    while True:
        while "nixl" in keep and not conn.poll(0.005):
            # the raw NIXL source has no progress thread (NIXL's spins a core at full speed, which
            # starved every other figure on a 2-core machine); UCX wire-up progresses here instead
            keep["nixl"][0].get_new_notifs()
        cmd, *a = conn.recv()
        if cmd == "exit":
            break
        if cmd == "sender":
            senders[a[0]] = create_sender(a[1], pool, TransferConfig(**a[2]))
            conn.send(True)
        elif cmd == "start":
            name, rid, desc, pages, tokens = a
            conn.send(senders[name].start(rid, [DestinationDescriptor.from_bytes(desc)], pages, tokens).state.name)
        elif cmd == "send":
            name, rid, compute_s = a
            s = senders[name]
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
            agent = api.nixl_agent("bench-raw-src", api.nixl_agent_config(enable_prog_thread=False))
            agent.register_memory(buf)
            keep["nixl"] = (agent, buf)
            conn.send((agent.get_agent_metadata(), buf.data_ptr(), a[0]))
        elif cmd == "raw_tcp":
            port, nbytes = a
            if "tcp" not in keep:
                keep["tcp"] = (socket.create_connection(("127.0.0.1", port)), np.ones(nbytes, dtype=np.uint8))
            sock, payload = keep["tcp"]
            sock.sendall(memoryview(payload))
            conn.send(True)
        elif cmd == "raw_grpc":
            port, nbytes, msg_bytes, streams = a
            key = ("grpc", port)
            if key not in keep:
                import grpc

                from kv_transfer.heap import keep_message_buffers

                keep_message_buffers(msg_bytes)  # as the transport does
                channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_options(streams))
                            for _ in range(streams)]
                keep[key] = ([c.stream_unary("/bench.RawBytes/Push") for c in channels], channels,
                             np.ones(msg_bytes, dtype=np.uint8).tobytes())
            pushes, _, payload = keep[key]
            per_stream = nbytes // msg_bytes // len(pushes)
            threads = [threading.Thread(target=push, args=(iter([payload] * per_stream),), kwargs={"timeout": 300})
                       for push in pushes]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            conn.send(True)
    for s in senders.values():
        s.close()
    for key, value in keep.items():
        if key == "tcp":
            value[0].close()
        elif isinstance(key, tuple):
            for channel in value[1]:
                channel.close()
    conn.send("bye")
