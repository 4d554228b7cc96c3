"""gRPC transport, sender side: one bidirectional Push stream per (request, destination).

send_layer() queues the layer number and returns; the stream's request iterator (run by
gRPC's own thread) cuts the layer into runs of at most `chunk_bytes`, aligned to both
page sizes, and yields one chunk per free permit; acknowledgements return permits. In-flight
memory is therefore bounded by `max_inflight_chunks x chunk_bytes` per stream plus gRPC's
flow-control window.

Hot path, per chunk: one gather of the run's pages into a reusable buffer (identical layouts
send whole pages, no token re-layout), then one copy into the encoded PushItem (header
encoded by protobuf, the payload field appended to it, so the payload is not copied through
a message object). Python gRPC waits for each message's send and each ack's send to finish,
so acking every chunk serializes the two sides: chunks go out with `defer_ack` and only
every `max_inflight_chunks // 2`-th chunk, and each layer's last, asks for an ack, whose
`items` count returns the permits of all chunks it covers.
A layer is confirmed when its last chunk is acknowledged; DONE when every destination has
confirmed every layer and the final notice. A refused chunk, a broken stream or the
deadline fails the request and unpins its pages.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from kv_transfer.base import KVSender, Ticker
from kv_transfer.config import TransferConfig
from kv_transfer.descriptor import DestinationDescriptor
from kv_transfer.handshake import HandshakeError, make_request
from kv_transfer.layout import KVPool
from kv_transfer.mapping import is_homogeneous, pages_of_run, plan_runs, read_token_run
from kv_transfer.sender_book import SenderReleaseFn
from kv_transfer.service import PeerSet, _describe
from kv_transfer.states import TransferState, TransferStatus
from proto.pdcluster.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Final:
    first_token: int
    prompt_len: int


@dataclass(slots=True)
class _Run:
    token_start: int
    num_tokens: int
    src_pages: torch.Tensor   # sender pages the run covers (whole-page runs)
    dst_page_ids: list[int]   # receiver pages the run covers


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


_CHUNK_FIELD = b"\x0a"  # PushItem.chunk: field 1, length-delimited
_DATA_FIELD = b"\x3a"   # PageChunk.data: field 7, length-delimited


def encode_chunk(header: pb.PageChunk, payload: memoryview) -> bytes:
    """The wire bytes of `PushItem(chunk=header with data=payload)`: protobuf encodes the
    header, the data field is appended (fields may come in any order), one copy of the payload."""
    body = header.SerializeToString() + _DATA_FIELD + _varint(payload.nbytes)
    return b"".join((_CHUNK_FIELD, _varint(len(body) + payload.nbytes), body, payload))


class _Stream:
    """One request's chunks to one destination."""

    def __init__(self, sender: GrpcSender, request_id: str, index: int, dest: DestinationDescriptor,
                 src_pages, deadline: float, peer) -> None:
        self.sender, self.request_id, self.index, self.dest = sender, request_id, index, dest
        self.src_pages = src_pages
        self.work: queue.Queue[int | _Final | None] = queue.Queue()
        self.permits = threading.Semaphore(sender.config.max_inflight_chunks)
        self.inflight: deque[tuple[int, bool] | None] = deque()  # (layer, last chunk?) or None for final
        self.stopped = threading.Event()
        src, dst = sender.pool.layout, dest.layout
        self.whole_pages = is_homogeneous(src, dst)
        dst_pages = dest.page_array()
        self.runs = [_Run(start, n, torch.from_numpy(pages_of_run(src_pages, src.page_size, start, n).astype(np.int64)),
                          pages_of_run(dst_pages, dst.page_size, start, n).tolist())
                     for start, n in plan_runs(dest.num_tokens, src, dst, sender.config.chunk_bytes)]
        self.ack_every = max(1, sender.config.max_inflight_chunks // 2)
        self._buffer: torch.Tensor | None = None  # whole-page gathers land here, reused chunk after chunk
        self.call = peer.push(self._items(), timeout=max(0.01, deadline - time.monotonic()))
        self.thread = threading.Thread(target=self._acks, name=f"kv-grpc-acks-{request_id}", daemon=True)
        self.thread.start()

    def _permit(self) -> bool:
        while not self.stopped.is_set():
            if self.permits.acquire(timeout=0.05):
                return True
        return False

    def _payload(self, layer: torch.Tensor, run: _Run) -> memoryview:
        if not self.whole_pages:
            data = read_token_run(layer, self.src_pages, self.sender.pool.layout, run.token_start, run.num_tokens)
            return memoryview(data.view(torch.uint8).numpy()).cast("B")
        k = len(run.src_pages)
        if self._buffer is None:
            self._buffer = torch.empty((max(len(r.src_pages) for r in self.runs), *layer.shape[1:]), dtype=layer.dtype)
        out = self._buffer[:k]
        torch.index_select(layer, 0, run.src_pages, out=out)
        return memoryview(out.view(torch.uint8).numpy()).cast("B")

    def _items(self):
        pool = self.sender.pool
        since_ack = 0
        while not self.stopped.is_set():
            try:
                item = self.work.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            if isinstance(item, _Final):
                if not self._permit():
                    return
                self.inflight.append(None)
                yield pb.PushItem(final=pb.FinalNotice(request_id=self.request_id, sender_id=self.sender.sender_id,
                                                       first_token=item.first_token, prompt_len=item.prompt_len)
                                  ).SerializeToString()
                return
            layer = pool.layers[item]
            for i, run in enumerate(self.runs):
                if not self._permit():
                    return
                last = i == len(self.runs) - 1
                since_ack += 1
                defer = not last and since_ack < self.ack_every
                if not defer:
                    since_ack = 0
                header = pb.PageChunk(request_id=self.request_id, sender_id=self.sender.sender_id, layer=item,
                                      token_start=run.token_start, num_tokens=run.num_tokens,
                                      dst_page_ids=run.dst_page_ids, whole_pages=self.whole_pages, defer_ack=defer)
                wire = encode_chunk(header, self._payload(layer, run))
                self.inflight.append((item, last))
                yield wire

    def _acks(self) -> None:
        book = self.sender.book
        try:
            for ack in self.call:
                if not ack.ok:
                    book.fail(self.request_id, f"receiver {self.dest.endpoint} refused: {ack.reason}")
                    return
                for _ in range(max(1, ack.items)):
                    what = self.inflight.popleft()
                    self.permits.release()
                    if what is None:
                        book.mark_final_sent(self.request_id, self.index)
                    elif what[1]:
                        book.confirm(self.request_id, self.index, what[0])
        except grpc.RpcError as exc:
            book.fail(self.request_id, f"stream to {self.dest.endpoint} broke: {_describe(exc)}")
        except Exception as exc:  # keep a bug visible as a failed request, never a hang
            log.exception("kv grpc ack reader")
            book.fail(self.request_id, f"ack reader crashed: {exc}")


class GrpcSender(KVSender):
    transport = "grpc"

    def __init__(self, pool: KVPool, config: TransferConfig | None = None,
                 on_release: SenderReleaseFn | None = None) -> None:
        super().__init__(pool, config or TransferConfig(), on_release)
        self._peers = PeerSet(self.config)
        self._streams: dict[str, list[_Stream]] = {}
        self.book.on_end = self._on_end
        self._reaper = Ticker("kv-grpc-send-reaper", self._reap, 0.02)

    def _reap(self) -> bool:
        self.book.reap()
        return False

    def _on_end(self, request_id: str) -> None:
        status = self.book.status(request_id)
        for stream in self._streams.pop(request_id, []):
            stream.stopped.set()
            stream.work.put(None)
            if status is None or status.state != TransferState.DONE:
                stream.call.cancel()  # the receiver sees the stream break and frees its pages

    def start(self, request_id: str, dests: list[DestinationDescriptor], src_pages: list[int],
              num_tokens: int) -> TransferStatus:
        out = self.book.start(request_id, src_pages, num_tokens, dests, self.config.deadline_s,
                              self.pool.layout.page_size)
        streams: list[_Stream] = []
        self._streams[request_id] = streams
        try:
            for i, dest in enumerate(dests):
                if dest.transport != self.transport:
                    raise HandshakeError(f"destination {dest.endpoint} speaks {dest.transport!r}, not grpc")
                peer = self._peers.get(dest.endpoint, lambda: make_request(
                    self.pool.spec, self.pool.layout, self.transport, self.sender_id))
                peer.begin(pb.BeginTransfer(request_id=request_id, sender_id=self.sender_id,
                                            src_page_ids=out.src_pages.tolist(), dst_page_ids=list(dest.page_ids),
                                            num_tokens=num_tokens))
                streams.append(_Stream(self, request_id, i, dest, out.src_pages, out.deadline, peer))
        except HandshakeError as exc:
            self.book.fail(request_id, str(exc))  # on_end cancels streams already open
            return out.status
        self.book.advance(request_id, TransferState.WAITING)
        return out.status

    def send_layer(self, request_id: str, layer: int) -> None:
        self._check_layer(layer)
        out = self.book.live(request_id)
        if layer in out.layers_sent:
            raise ValueError(f"layer {layer} of {request_id!r} was already sent")
        out.layers_sent.add(layer)
        self.book.advance(request_id, TransferState.TRANSFERRING)
        for stream in self._streams.get(request_id, []):
            stream.work.put(layer)

    def finish(self, request_id: str, first_token: int, prompt_len: int) -> None:
        out = self.book.live(request_id)
        missing = set(range(self.pool.layout.num_layers)) - out.layers_sent
        if missing:
            raise ValueError(f"finish({request_id!r}) before layers {sorted(missing)[:8]} were sent")
        for stream in self._streams.get(request_id, []):
            stream.work.put(_Final(first_token, prompt_len))

    def close(self) -> None:
        self._reaper.stop()
        for rid in self.book.active_ids():
            self.book.fail(rid, "sender closed")
        self._peers.close()
