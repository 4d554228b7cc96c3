"""Tensor parallelism (Megatron-style) inside one engine: which heads a rank holds, the rank's
process group, and how each step's inputs reach the other ranks.

Sharding (engine/model.py, engine/loader.py). With N ranks, rank r holds:
- q heads [r * H/N, (r+1) * H/N) (H % N == 0 required);
- KV heads [r * K/N, (r+1) * K/N) when N divides K; when N is a multiple of K, the one KV head
  r * K // N, replicated on N/K ranks (exactly the KV head its q heads read);
- columns [r * I/N, (r+1) * I/N) of gate/up (I: intermediate size);
- the matching input slices of o_proj and down_proj (row-parallel): each rank's output is a
  partial sum, all-reduced once per projection, the bias (if any) added once after the reduce;
- the embedding and the norms whole; the LM head whole (replicated: only the leader computes
  logits), or with `vocab_parallel` its rows [r * V/N, (r+1) * V/N): every rank computes its
  slice of the sampled rows' logits and the leader gathers them (V % N == 0 required).
Its KV cache holds only its own KV heads; page ids mean the same page on every rank, because
one block pool (the leader's) allocates them.

One scheduler: rank 0, the **leader**, runs the EngineCore (scheduler, sampler, detokenizer,
connector policy). Each step it pushes the batch's inputs (`encode_step`: token ids, positions,
slots, query and context lengths, block tables) onto one queue per follower in the group's
TCPStore; a **follower** (engine/tp_worker.py) pops them and runs only its shard of the model.
The forward's all-reduces keep the ranks in step: no rank returns from a step before every
rank reached its last layer.

The group is fragile on purpose: losing a rank is losing the engine. A follower that exits is
seen by the leader before the next step (`liveness`), a collective with a dead peer fails at
once (gloo: "connection closed"), a stuck one after `timeout_s`; from then on every step
raises `TPGroupError` naming the cause, and the group must be replaced as a whole.
"""
from __future__ import annotations

import datetime
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from engine.config import ModelConfig

DEFAULT_TIMEOUT_S = 120.0  # a collective (one layer's all-reduce) waits this long for its peers
_STEP_QUEUE = "step/{rank}"
_STOP = b""
# A follower's queue carries, in order: steps (tag + encode_step), connector commands (tag + the
# command's bytes, which the follower's KV connector parses: kv_transfer/tp_connector.py), and
# _STOP. A command pushed before a step is handled before that step runs.
_STEP_TAG, _COMMAND_TAG = b"S", b"C"


class TPGroupError(RuntimeError):
    """A rank of the tensor-parallel group is lost or out of step: the engine cannot go on."""


def check_tensor_parallel(cfg: ModelConfig, world: int) -> None:
    """Raise ValueError unless `world` ranks can each hold whole heads of this model."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {world!r}")
    h, k, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if h % world or (k % world and world % k) or inter % world:
        raise ValueError(
            f"tensor_parallel_size={world} (engine.tensor_parallel_size) does not fit this model: it must divide "
            f"num_attention_heads={h} and intermediate_size={inter}, and divide or be a multiple of "
            f"num_key_value_heads={k}"
        )


@dataclass(slots=True, frozen=True)
class TPShard:
    """What rank `rank` of `world` holds (see the module docstring)."""

    rank: int
    world: int
    num_heads: int  # q heads here
    q_head_start: int
    num_kv_heads: int  # KV heads here (1, replicated, when world > the model's KV heads)
    kv_head_start: int
    intermediate_size: int
    intermediate_start: int
    vocab_size: int  # LM head rows here: the whole vocabulary unless vocab-parallel
    vocab_start: int = 0
    vocab_parallel: bool = False

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, world: int = 1, vocab_parallel: bool = False) -> "TPShard":
        check_tensor_parallel(cfg, world)
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        qpr, ipr = cfg.num_heads // world, cfg.intermediate_size // world
        k = cfg.num_kv_heads
        kv = (k // world, rank * k // world) if k >= world else (1, rank * k // world)
        vocab = (cfg.vocab_size, 0, False)
        if vocab_parallel and world > 1:
            if cfg.vocab_size % world:
                raise ValueError(f"a vocab-parallel LM head needs vocab_size={cfg.vocab_size} divisible by "
                                 f"tensor_parallel_size={world}")
            vpr = cfg.vocab_size // world
            vocab = (vpr, rank * vpr, True)
        return cls(rank, world, qpr, rank * qpr, kv[0], kv[1], ipr, rank * ipr, *vocab)


    @property
    def q_heads(self) -> range:
        return range(self.q_head_start, self.q_head_start + self.num_heads)

    @property
    def kv_heads(self) -> range:
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)


# ---- the step's inputs, leader -> followers ---------------------------------------------------
@dataclass(slots=True)
class StepInputs:
    """One step's model inputs on the host; everything a rank needs to run its shard."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits are sampled


_HEADER = struct.Struct("<5q")  # num_seqs, num_tokens, num_decodes, block table entries, sample rows


def encode_step(s: StepInputs) -> bytes:
    bt_lens = np.fromiter((len(t) for t in s.block_tables), dtype=np.int64, count=len(s.block_tables))
    flat = np.fromiter((p for t in s.block_tables for p in t), dtype=np.int64, count=int(bt_lens.sum()))
    body = np.concatenate([
        s.input_ids.astype(np.int64, copy=False), s.positions.astype(np.int64, copy=False),
        s.slot_mapping.astype(np.int64, copy=False), np.asarray(s.query_lens, dtype=np.int64),
        np.asarray(s.context_lens, dtype=np.int64), bt_lens, flat, np.asarray(s.sample_rows, dtype=np.int64),
    ])
    return (_HEADER.pack(len(s.query_lens), len(s.input_ids), s.num_decodes, len(flat), len(s.sample_rows))
            + body.tobytes())


def decode_step(buf: bytes) -> StepInputs:
    n, t, nd, nb, ns = _HEADER.unpack_from(buf)
    a = np.frombuffer(buf, dtype=np.int64, offset=_HEADER.size).copy()  # writable: torch.from_numpy
    if len(a) != 3 * t + 3 * n + nb + ns:
        raise TPGroupError(f"malformed step message: {len(a)} values for {n} sequences, {t} tokens, {nb} pages")
    ids, pos, slots = a[:t], a[t : 2 * t], a[2 * t : 3 * t]
    o = 3 * t
    qlens, clens, bt_lens = a[o : o + n].tolist(), a[o + n : o + 2 * n].tolist(), a[o + 2 * n : o + 3 * n]
    flat = a[o + 3 * n : o + 3 * n + nb].tolist()
    ends = np.cumsum(bt_lens).tolist()
    tables = [flat[e - k : e] for e, k in zip(ends, bt_lens.tolist())]
    return StepInputs(ids, pos, slots, qlens, clens, tables, nd, a[o + 3 * n + nb :].tolist())


# ---- the group ---------------------------------------------------------------------------------
def parse_init_method(init_method: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' -> (HOST, PORT)."""
    if not init_method.startswith("tcp://"):
        raise ValueError(f"init_method must be tcp://HOST:PORT, got {init_method!r}")
    host, _, port = init_method[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)


TRANSPORTS = ("gloo", "socket")


class SocketReducer:
    """All-reduce and gather for CPU ranks over one TCP connection per follower, through the
    leader (a star): each follower sends its partial sum, the leader adds them in rank order
    (rank 0 + rank 1 + ...) and sends the sum back, so every rank gets the leader's bits. One
    round trip per all-reduce. On a 2-core VM gloo's all-reduce of a decode step's hidden state
    took ~1.2 ms where a socket round trip takes ~0.06 ms (bench/tp_bench.py compares them).
    Messages from a follower carry their length, checked by the leader; a closed connection or a
    peer silent for `timeout_s` raises (TPGroup turns that into TPGroupError)."""

    _LEN = struct.Struct("<q")

    def __init__(self, store: dist.Store, rank: int, world: int, host: str, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.peers: list[socket.socket] = []  # leader: ranks 1..world-1 in order; follower: [leader]
        self._scratch = torch.empty(0, dtype=torch.uint8)
        if rank == 0:
            with socket.create_server((host, 0)) as server:
                server.settimeout(timeout_s)
                store.set("tp/reduce_addr", f"{host}:{server.getsockname()[1]}")
                by_rank: dict[int, socket.socket] = {}
                while len(by_rank) < world - 1:
                    conn, _ = server.accept()
                    conn.settimeout(timeout_s)
                    by_rank[self._LEN.unpack(_recv_exact(conn, memoryview(bytearray(8))))[0]] = conn
                self.peers = [by_rank[r] for r in range(1, world)]
        else:
            store.wait(["tp/reduce_addr"], datetime.timedelta(seconds=timeout_s))
            addr_host, _, port = store.get("tp/reduce_addr").decode().rpartition(":")
            conn = socket.create_connection((addr_host, int(port)), timeout=timeout_s)
            conn.sendall(self._LEN.pack(rank))
            self.peers = [conn]
        for conn in self.peers:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _scratch_bytes(self, n: int) -> torch.Tensor:
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.uint8)
        return self._scratch[:n]

    def all_reduce(self, t: torch.Tensor) -> None:
        raw = _bytes_of(t)
        if self.rank != 0:
            self._io(0, self._send_message, self.peers[0], raw)
            self._io(0, _recv_exact, self.peers[0], raw)
            return
        scratch = self._scratch_bytes(len(raw))
        for r, conn in enumerate(self.peers, start=1):
            self._io(r, self._recv_message, conn, r, memoryview(scratch.numpy()))
            t.add_(scratch.view(t.dtype).view(t.shape))
        for r, conn in enumerate(self.peers, start=1):
            self._io(r, conn.sendall, raw)

    def gather(self, local: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """Followers send `local`; the leader gets every rank's into `parts` (its own first)."""
        if self.rank != 0:
            self._io(0, self._send_message, self.peers[0], _bytes_of(local))
            return
        parts[0].copy_(local)
        for r, conn in enumerate(self.peers, start=1):
            self._io(r, self._recv_message, conn, r, _bytes_of(parts[r]))

    def _io(self, rank: int, fn, *args) -> None:
        """Run one send or receive with rank `rank`; a lost or silent peer raises, naming it."""
        try:
            fn(*args)
        except TimeoutError as exc:
            raise TimeoutError(f"rank {rank} silent for {self.timeout_s:g} s") from exc
        except OSError as exc:  # closed, reset, broken pipe: the peer is gone
            raise ConnectionError(f"connection to rank {rank} lost ({exc})") from exc

    def _send_message(self, conn: socket.socket, raw: memoryview) -> None:
        header = self._LEN.pack(len(raw))
        sent = conn.sendmsg([header, raw])  # one segment for small messages; finish what it left
        if sent < len(header):
            conn.sendall(header[sent:])
            conn.sendall(raw)
        elif sent < len(header) + len(raw):
            conn.sendall(raw[sent - len(header):])

    def _recv_message(self, conn: socket.socket, rank: int, buf: memoryview) -> None:
        (n,) = self._LEN.unpack(_recv_exact(conn, memoryview(bytearray(8))))
        if n != len(buf):
            raise TPGroupError(f"rank {rank} sent {n} bytes where {len(buf)} were due: the ranks are out of step")
        _recv_exact(conn, buf)

    def shutdown(self) -> None:
        for conn in self.peers:
            conn.close()
        self.peers = []


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    if not t.is_contiguous():
        raise ValueError("tensor-parallel messages need contiguous tensors")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _recv_exact(conn: socket.socket, buf: memoryview) -> memoryview:
    view, got = buf, 0
    while got < len(buf):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("closed by the peer")
        got += n
    return buf


class TPGroup:
    """This rank's end of a tensor-parallel group of `world` ranks.

    `store` is the group's TCPStore (the leader hosts it; followers connect to it): the step
    queues and the start-up handshake go through it, and it is the rendezvous of the device
    process group (gloo on CPU, bound to `host`; NCCL on CUDA) that carries the all-reduces.
    The process group is private to this object (no torch.distributed default group), so one
    process can hold several engines.
    """

    def __init__(self, store: dist.Store, rank: int, world: int, device: torch.device, *,
                 host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S,
                 liveness: Callable[[], None] | None = None, transport: str = "gloo") -> None:
        """`transport` (CPU): "gloo", torch.distributed's process group, or "socket", the
        leader-centred `SocketReducer`; on CUDA the all-reduces always go over NCCL."""
        if transport not in TRANSPORTS:
            raise ValueError(f"tp transport must be one of {list(TRANSPORTS)}, got {transport!r}")
        self.transport = "nccl" if torch.device(device).type == "cuda" else transport
        self.store, self.rank, self.world, self.device = store, rank, world, torch.device(device)
        self.timeout_s = timeout_s
        self.liveness = liveness  # raises TPGroupError when a rank is known to be gone
        self.broken: str | None = None
        self.host = host
        self.pg = None
        self.num_steps = 0

    def connect(self) -> None:
        """Join the device process group; returns once every rank has joined (or raises after
        `timeout_s`). The model can be built before: it only calls `all_reduce` in a step."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        prefixed = dist.PrefixStore("tp-pg", self.store)
        if self.transport == "socket":
            self.pg = SocketReducer(self.store, self.rank, self.world, self.host, self.timeout_s)
        elif self.transport == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, self.rank, self.world, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            self.pg = dist.ProcessGroupGloo(prefixed, self.rank, self.world, opts)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- in the forward ---------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place."""
        try:
            if self.transport == "socket":
                self.pg.all_reduce(t)
            else:
                self.pg.allreduce([t]).wait()
        except (RuntimeError, OSError) as exc:
            self.mark_broken(f"all-reduce on rank {self.rank} failed: {_first_line(exc)}")
            raise TPGroupError(self.broken) from exc
        return t

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """Vocab-parallel LM head: every rank's [rows, V/N] slice to the leader, which gets the
        [rows, V] logits (None on the followers)."""
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.is_leader else []
        try:
            if self.transport == "socket":
                self.pg.gather(local, parts)
            else:
                opts = dist.GatherOptions()
                opts.rootRank = 0
                self.pg.gather([parts] if self.is_leader else [], [local], opts).wait()
        except (RuntimeError, OSError) as exc:
            self.mark_broken(f"gathering logits on rank {self.rank} failed: {_first_line(exc)}")
            raise TPGroupError(self.broken) from exc
        return torch.cat(parts, dim=1) if self.is_leader else None

    # -- leader ------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise TPGroupError if the group cannot run a step (a lost rank, an earlier failure);
        the message names a rank known to be gone, whatever broke the group first."""
        if self.broken is None and self.pg is None:
            self.mark_broken("the process group is not connected (closed, or never joined)")
        lost = None
        if self.liveness is not None:
            try:
                self.liveness()
            except TPGroupError as exc:
                lost = str(exc)
                self.mark_broken(lost)
        if self.broken is not None:
            extra = f"; {lost}" if lost is not None and lost not in self.broken else ""
            raise TPGroupError(f"tensor-parallel group of {self.world} ranks is broken: {self.broken}{extra}")

    def send_step(self, inputs: StepInputs) -> None:
        """Leader: hand this step's inputs to every follower (they start at once)."""
        self.check()
        msg = _STEP_TAG + encode_step(inputs)
        try:
            for r in range(1, self.world):
                self.store.queue_push(_STEP_QUEUE.format(rank=r), msg)
        except RuntimeError as exc:
            self.mark_broken(f"sending a step failed: {_first_line(exc)}")
            raise TPGroupError(self.broken) from exc
        self.num_steps += 1

    def send_command(self, rank: int, command: bytes) -> None:
        """Leader: queue a connector command for follower `rank`, after the steps sent so far and
        before the next one. Raises TPGroupError when the group is broken."""
        self.check()
        try:
            self.store.queue_push(_STEP_QUEUE.format(rank=rank), _COMMAND_TAG + command)
        except RuntimeError as exc:
            self.mark_broken(f"sending a connector command failed: {_first_line(exc)}")
            raise TPGroupError(self.broken) from exc

    def mark_broken(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason

    def stop_followers(self) -> None:
        """Leader: tell every follower to leave its loop (best effort: a dead store is fine)."""
        for r in range(1, self.world):
            try:
                self.store.queue_push(_STEP_QUEUE.format(rank=r), _STOP)
            except RuntimeError:
                return

    # -- follower ----------------------------------------------------------------------------
    def recv(self) -> StepInputs | bytes | None:
        """Follower: the next message: a step's inputs, a connector command (its bytes), or None
        when the leader stops the group. Waits as long as the leader is idle; raises
        TPGroupError when the leader (its store) is gone."""
        key = _STEP_QUEUE.format(rank=self.rank)
        while True:
            try:
                msg = self.store.queue_pop(key)
            except dist.DistStoreError:  # the store's wait timed out: the leader is idle
                continue
            except RuntimeError as exc:  # DistNetworkError and the like: the leader's store is gone
                raise TPGroupError(f"rank {self.rank} lost its leader: {_first_line(exc)}") from exc
            if msg == _STOP:
                return None
            if msg[:1] == _COMMAND_TAG:
                return msg[1:]
            if msg[:1] != _STEP_TAG:
                raise TPGroupError(f"rank {self.rank} got a message of unknown kind {msg[:1]!r}")
            self.num_steps += 1
            return decode_step(msg[1:])

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError, OSError):
                pass


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__
