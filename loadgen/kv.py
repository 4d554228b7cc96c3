"""Timed KV transfers between two processes: the receiver in this process, the sender in a
spawned child (loadgen/kv_child.py), over any transport. `bench kv` measures bandwidth with it,
`plan profile` the transfer cost it fits.
"""
from __future__ import annotations

import time


class Paged:
    """Paged transfers of one transport from the child's sender to a receiver here. `once()`
    times one request from the sender's first layer to DONE here, and returns (seconds,
    descriptor set-up CPU seconds, set-up wall seconds, seconds the sender really computed);
    set-up figures are those of the nixl receiver (0 for others)."""

    def __init__(self, conn, transport: str, pool, tokens: int, config_kw: dict | None = None,
                 name: str | None = None) -> None:
        from kv_transfer.config import TransferConfig
        from kv_transfer.registry import create_receiver

        self.conn, self.transport, self.pool, self.tokens = conn, transport, pool, tokens
        self.name = name or transport
        config_kw = config_kw or {}
        self.recv = create_receiver(transport, pool, TransferConfig(**config_kw))
        conn.send(("sender", self.name, transport, config_kw))
        conn.recv()
        self._n = 0
        self.last_reads = 0  # READs the last request took (nixl)

    def once(self, compute_s: float = 0.0, tokens: int | None = None) -> tuple[float, float, float, float]:
        tokens = tokens or self.tokens
        rid = f"{self.name}-{self._n}"
        self._n += 1
        pages = list(range(self.pool.layout.pages_for(tokens)))
        desc = self.recv.expect(rid, pages, tokens, deadline_s=300)
        self.conn.send(("start", self.name, rid, desc.to_bytes(), pages, tokens))
        if (state := self.conn.recv()) != "WAITING":
            raise RuntimeError(f"{self.transport} sender start ended {state}")
        t0 = time.perf_counter()
        self.conn.send(("send", self.name, rid, compute_s))
        status = self.recv.wait(rid, 300)
        elapsed = time.perf_counter() - t0
        if status.state.name != "DONE":
            raise RuntimeError(f"{self.transport} transfer ended {status.state.name}: {status.error}")
        sender_state, computed = self.conn.recv()
        if sender_state != "DONE":
            raise RuntimeError(f"{self.transport} sender ended {sender_state}")
        self.recv.take(rid)
        setup = getattr(self.recv, "setup_s", {}).pop(rid, 0.0), getattr(self.recv, "setup_wall_s", {}).pop(rid, 0.0)
        reads = getattr(self.recv, "reads", None)
        self.last_reads = reads.reads_posted.pop(rid, 0) if reads is not None else 0
        return elapsed, setup[0], setup[1], computed

    def close(self) -> None:
        self.recv.close()


def spawn_child(spec_kw: dict, layout_kw: dict, num_pages: int):
    import multiprocessing as mp

    from loadgen.kv_child import child_main

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=child_main, args=(child_conn, spec_kw, layout_kw, num_pages), daemon=True)
    child.start()
    return conn, child


def stop_child(conn, child) -> None:
    try:
        conn.send(("exit",))
        conn.recv()
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def measure_transfer(transport: str, spec_kw: dict, layout_kw: dict, token_sizes, repeats: int = 3,
                     config_kw: dict | None = None) -> list[tuple[int, int, list[float]]]:
    """Paged KV transfers of each size in `token_sizes` from a spawned sender process to a
    receiver here, over one receiver/sender pair: (tokens, payload bytes, seconds per repeat)
    per size, each timed from the sender's first layer to DONE here, after one untimed warm-up
    of the largest size (faults every page in) and one of each size."""
    import os

    from kv_transfer.layout import KVLayout, KVPool, ModelSpec

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    layout = KVLayout(**layout_kw)
    num_pages = layout.pages_for(max(token_sizes))
    pool = KVPool.allocate(ModelSpec(**spec_kw), layout, num_pages)
    conn, child = spawn_child(spec_kw, layout_kw, num_pages)
    out = []
    try:
        paged = Paged(conn, transport, pool, max(token_sizes), config_kw)
        try:
            paged.once()  # faults every page in
            for tokens in token_sizes:
                paged.once(tokens=tokens)
                times = [paged.once(tokens=tokens)[0] for _ in range(repeats)]
                out.append((tokens, layout.pages_for(tokens) * layout.page_bytes * layout.num_layers, times))
        finally:
            paged.close()
    finally:
        stop_child(conn, child)
    return out
