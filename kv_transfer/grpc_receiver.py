"""gRPC transport, receiver side: chunks of token runs arrive on a bidirectional stream
and are validated, then written straight into the request's destination pages.

Lifecycle per request: expect() -> sender Handshake (once per sender) -> Begin (checks
dst page ids against the allocation) -> Push stream of chunks, each acknowledged (the
sender keeps at most `max_inflight_chunks` unacknowledged, which bounds memory; chunks sent
with `defer_ack` are counted by the next Ack's `items` instead) -> final notice -> DONE.
Chunks are written from the message's own bytes (wire.decode_push: a read-only view, no
copy through protobuf): whole-page chunks span by span (mapping.write_pages) into the
destination pages, token runs through mapping.write_token_run. A rejected chunk fails the request and ends the stream with a refusal;
a stream that breaks or ends before its final notice fails the request; the deadline
fails anything still open. Failed requests' pages go back through `on_release`.

The service is grpc.aio (service.AsyncService): every handler, the chunk writes included,
runs on the process's KV service loop, and no call holds a thread while it is open, so any
number of concurrent streams leaves Handshake and Begin answered at once. (A sync server
held one thread per open Push stream: past `server_threads` streams, Begin queued until
its 5 s deadline.)
"""
from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

from kv_transfer.base import KVReceiver, Ticker
from kv_transfer.config import TransferConfig
from kv_transfer.handshake import answer
from kv_transfer.heap import keep_message_buffers
from kv_transfer.layout import KVLayout, KVPool, torch_dtype
from kv_transfer.mapping import write_pages, write_token_run
from kv_transfer.receiver_book import DoneFn, ReleaseFn, TransferRejected
from kv_transfer.service import AsyncService
from kv_transfer.wire import PushFrame
from proto.pdcluster.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)


def _silence_read_only_buffer_warning() -> None:
    """Chunks are tensors over the read-only bytes gRPC delivered, which torch warns about once
    per process: have that one warning now, silenced, rather than pay for a warnings context
    on every chunk (~10 us each)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0" * 4, dtype=torch.uint8)


_silence_read_only_buffer_warning()


class _PushStream:
    """One Push stream: the requests whose chunks came on it, and the deferred chunks the next
    Ack covers (service.PushStream)."""

    def __init__(self, receiver: GrpcReceiver) -> None:
        self.receiver = receiver
        self.open_requests: dict[str, str] = {}  # request -> sender, chunks of it came on this stream
        self.unacked = 0

    def item(self, item: PushFrame) -> pb.Ack | None:
        self.unacked += 1
        try:
            if item.chunk is not None:
                self.open_requests[item.chunk.request_id] = item.chunk.sender_id
                ack = self.receiver._write_chunk(item.chunk, item.payload)
                if ack.ok and item.chunk.defer_ack:
                    return None
            else:
                ack = self.receiver._final(item.final)
                if ack.ok:
                    self.open_requests.pop(item.final.request_id, None)
        except TransferRejected as exc:
            return pb.Ack(ok=False, reason=str(exc))
        ack.items, self.unacked = self.unacked, 0
        return ack

    def end(self, clean: bool) -> None:
        # A sender's lanes other than the one carrying its final notice end cleanly once that
        # sender is done; any other end leaves the request short of bytes or notice.
        book = self.receiver.book
        for rid, sender_id in self.open_requests.items():
            if not (clean and book.has_final(rid, sender_id)):
                book.fail(rid, "sender stream ended before its final notice")


class GrpcReceiver(KVReceiver):
    transport = "grpc"

    def __init__(self, pool: KVPool, config: TransferConfig | None = None, on_release: ReleaseFn | None = None,
                 on_done: DoneFn | None = None) -> None:
        super().__init__(pool, config or TransferConfig(), on_release, on_done)
        if self.config.grpc_tune_malloc:
            keep_message_buffers(self.config.chunk_bytes)
        self._senders: dict[str, KVLayout] = {}
        self._service = AsyncService(self, self.config)
        self._reaper = Ticker("kv-grpc-reaper", self._reap, 0.02)

    @property
    def endpoint(self) -> str:
        return f"{self.config.host}:{self._service.port}"

    def _reap(self) -> bool:
        self.book.reap()
        return False

    # ---- service handlers -------------------------------------------------------------------
    def handle_handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeReply:
        reply = answer(request, self.pool.spec, self.pool.layout, self.transport, self.receiver_id,
                       self.config.allowed_dtype_conversions)
        if reply.accepted:
            self._senders[request.sender_id] = KVLayout.from_proto(request.layout)
        else:
            log.warning("kv handshake from %s refused: %s", request.sender_id, reply.reason)
        return reply

    def handle_begin(self, request: pb.BeginTransfer) -> pb.Ack:
        layout = self._senders.get(request.sender_id)
        if layout is None:
            return pb.Ack(ok=False, reason=f"sender {request.sender_id!r} has not handshaken")
        try:
            self.book.begin(request.request_id, request.sender_id, layout, list(request.dst_page_ids), request.num_tokens)
        except TransferRejected as exc:
            return pb.Ack(ok=False, reason=str(exc))
        return pb.Ack(ok=True)

    def handle_cancel(self, request: pb.Abort) -> pb.Ack:
        self.book.fail(request.request_id, f"cancelled by sender: {request.reason}")
        return pb.Ack(ok=True)

    def open_push(self) -> _PushStream:
        return _PushStream(self)

    def _write_chunk(self, chunk: pb.PageChunk, raw: memoryview) -> pb.Ack:
        dst_page_ids = np.asarray(list(chunk.dst_page_ids), dtype=np.int64)
        inc = self.book.check_run(chunk.request_id, chunk.sender_id, chunk.layer, chunk.token_start,
                                  chunk.num_tokens, dst_page_ids, raw.nbytes, whole_pages=chunk.whole_pages)
        src = inc.senders[chunk.sender_id]
        try:
            data = torch.frombuffer(raw, dtype=torch_dtype(src.dtype))  # read-only bytes, only read from
            layer = self.pool.layers[chunk.layer]
            if chunk.whole_pages:
                write_pages(layer, dst_page_ids, data.view(len(dst_page_ids), *layer.shape[1:]))
            else:
                data = data.view(2, chunk.num_tokens, src.num_heads, src.head_dim)
                write_token_run(layer, inc.page_ids, self.pool.layout, chunk.token_start, data, src)
        except Exception as exc:  # a malformed chunk must fail its request, not the server
            self.book.abort_write(chunk.request_id, f"chunk could not be written: {exc}")
            return pb.Ack(ok=False, reason=str(exc))
        self.book.mark(chunk.request_id, chunk.sender_id, chunk.layer, chunk.token_start, chunk.num_tokens)
        return pb.Ack(ok=True)

    def _final(self, final: pb.FinalNotice) -> pb.Ack:
        self.book.final(final.request_id, final.sender_id, final.first_token, final.prompt_len)
        return pb.Ack(ok=True)

    def close(self) -> None:
        self._reaper.stop()
        self._service.stop(grace=0.5)
        for rid in self.book.active_ids():
            self.book.fail(rid, "receiver closed")
