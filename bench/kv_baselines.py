"""Baselines of `pdcluster bench kv`, the receiving side of each (the sending side lives in
loadgen/kv_child.py). Each is an object whose `once()` times one transfer of the same bytes,
so the benchmark can take baseline and paged samples in turns and compare each paged sample
with the baseline sample taken next to it (both then see the same background load).

- memcpy: single-thread copy of the payload, what one core's copy costs.
- raw NIXL: one READ of one contiguous registered buffer, no pages.
- raw TCP: one loopback socket, kept open, received into one buffer.
- raw gRPC: bare client streams of `msg_bytes` bytes messages (identity serializers, no page
  handling or acknowledgements) over `streams` channels in parallel: what Python gRPC itself
  costs, with as many connections as the transport's data lanes, and (both processes) the
  transport's heap settings (kv_transfer/heap.py), so it differs from the transport only in
  page handling.
"""
from __future__ import annotations

import socket
import threading
import time
from concurrent import futures


class Memcpy:
    def __init__(self, nbytes: int) -> None:
        import torch

        self.src, self.dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

    def once(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.src = self.dst = None


class RawNixl:
    """One raw NIXL READ of one contiguous buffer from the child process."""

    def __init__(self, conn, nbytes: int) -> None:
        import numpy as np
        import torch

        from kv_transfer.nixl_pool import nixl_api

        api = nixl_api()
        conn.send(("raw_nixl", nbytes))
        md, addr, _ = conn.recv()
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)  # lazily zeroed, like the pool: the warm-up faults it in
        self.agent = api.nixl_agent("bench-raw-dst", api.nixl_agent_config(enable_prog_thread=False))
        self.agent.register_memory(self.dst)
        name = self.agent.add_remote_agent(md)
        self.remote_name = name.decode() if isinstance(name, bytes) else name
        self.local = self.agent.get_xfer_descs(np.array([[self.dst.data_ptr(), nbytes, 0]], dtype=np.uint64), "DRAM")
        self.remote = self.agent.get_xfer_descs(np.array([[addr, nbytes, 0]], dtype=np.uint64), "DRAM")

    def once(self) -> float:
        handle = self.agent.initialize_xfer("READ", self.local, self.remote, self.remote_name)
        t0 = time.perf_counter()
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"raw NIXL read ended {state}")
        self.agent.release_xfer_handle(handle)
        return elapsed

    def close(self) -> None:
        pass  # the agent lives as long as this object; NIXL tears it down with the process


class RawTcp:
    """A loopback socket kept open; each sample is nbytes, timed from the first byte received."""

    def __init__(self, conn, nbytes: int) -> None:
        import numpy as np

        self.conn, self.nbytes = conn, nbytes
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(1)
        self.sock: socket.socket | None = None
        self.buf = memoryview(np.empty(nbytes, dtype=np.uint8))

    def once(self) -> float:
        self.conn.send(("raw_tcp", self.server.getsockname()[1], self.nbytes))
        if self.sock is None:
            self.sock, _ = self.server.accept()
        got, t0 = 0, None
        while got < self.nbytes:
            n = self.sock.recv_into(self.buf[got:], min(8 << 20, self.nbytes - got))
            if n == 0:
                raise ConnectionError("raw TCP sender closed the connection")
            t0 = t0 or time.perf_counter()  # timed from the first byte
            got += n
        elapsed = time.perf_counter() - t0
        self.conn.recv()
        return elapsed

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.server.close()


class RawGrpc:
    """Bare gRPC client streams into a server here, timed from the first message of any
    stream to the last byte of all of them."""

    def __init__(self, conn, nbytes: int, msg_bytes: int = 1 << 20, streams: int = 1) -> None:
        import grpc

        from loadgen.kv_child import grpc_options
        from kv_transfer.heap import keep_message_buffers

        keep_message_buffers(msg_bytes)  # the heap settings the transport runs with (kv_transfer/heap.py)
        self.conn, self.nbytes, self.msg_bytes, self.streams = conn, nbytes, msg_bytes, streams
        self._lock = threading.Lock()
        self._t0: float | None = None
        self._got = 0
        self._end: float | None = None
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max(2, streams)),
                                  options=grpc_options(streams))
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "bench.RawBytes", {"Push": grpc.stream_unary_rpc_method_handler(self._push)})])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _push(self, messages, context) -> bytes:
        for m in messages:
            with self._lock:
                self._t0 = self._t0 or time.perf_counter()
                self._got += len(m)
                if self._got >= self.total:
                    self._end = time.perf_counter()
        return b""

    @property
    def total(self) -> int:
        return self.nbytes // self.msg_bytes // self.streams * self.msg_bytes * self.streams

    def once(self) -> float:
        self._t0, self._got, self._end = None, 0, None
        self.conn.send(("raw_grpc", self.port, self.nbytes, self.msg_bytes, self.streams))
        self.conn.recv()
        if self._end is None:
            raise RuntimeError("raw gRPC streams ended before every byte arrived")
        # scaled to nbytes, in case nbytes is not a multiple of the messages
        return (self._end - self._t0) * self.nbytes / self.total

    def close(self) -> None:
        self.server.stop(0)
