"""gRPC transport, sender side: one bidirectional Push stream per (request, destination).

send_layer() queues the layer number and returns; the stream's request iterator (run by
gRPC's own thread) cuts the layer into runs of at most `chunk_bytes`, aligned to both
page sizes, and yields one chunk per free permit; acknowledgements return permits. In-flight
memory is therefore bounded by `max_inflight_chunks x chunk_bytes` per stream plus gRPC's
flow-control window.

Hot path, per chunk: one gather of the run's pages straight into the encoded PushItem
(identical layouts send whole pages, no token re-layout; wire.encode_chunk_into: the payload
field first, then the header encoded by protobuf, no copy through a message object or a
staging buffer). Data lanes (`grpc_streams` > 1) stripe layers over streams of their
own connections; on a 2-core machine they do not help (docs/benchmarks.md). Python gRPC
waits for each message's send and each ack's send to finish, so acking every chunk
serializes the two sides: chunks go out with `defer_ack` and only every
`max_inflight_chunks // 2`-th chunk, and each layer's last, asks for an ack, whose `items`
count returns the permits of all chunks it covers.
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
from kv_transfer.heap import keep_message_buffers
from kv_transfer.layout import KVPool
from kv_transfer.mapping import is_homogeneous, pages_of_run, plan_runs, read_token_run
from kv_transfer.sender_book import SenderReleaseFn
from kv_transfer.service import PeerSet, _describe
from kv_transfer.states import TransferState, TransferStatus
from kv_transfer.wire import encode_chunk, encode_chunk_into, encode_final
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


class _Lane:
    """One Push stream of a request to one destination, carrying the layers `l` with
    `l % lanes == index`, then a final notice."""

    def __init__(self, route: _Route, index: int) -> None:
        self.route, self.index = route, index
        self.work: queue.Queue[int | _Final | None] = queue.Queue()
        self.permits = threading.Semaphore(route.sender.config.max_inflight_chunks)
        self.inflight: deque[tuple[int, bool] | None] = deque()  # (layer, last chunk?) or None for final
        self.call = route.peer.push(index)(self._items(), timeout=max(0.01, route.deadline - time.monotonic()))
        self.thread = threading.Thread(target=self._acks, name=f"kv-grpc-acks-{route.request_id}-{index}",
                                       daemon=True)
        self.thread.start()

    def _permit(self) -> bool:
        while not self.route.stopped.is_set():
            if self.permits.acquire(timeout=0.05):
                return True
        return False

    def _encode(self, header: pb.PageChunk, layer: torch.Tensor, run: _Run) -> bytes:
        route = self.route
        if not route.whole_pages:
            data = read_token_run(layer, route.src_pages, route.sender.pool.layout, run.token_start, run.num_tokens)
            return encode_chunk(header, memoryview(data.view(torch.uint8).numpy()).cast("B"))
        shape = (len(run.src_pages), *layer.shape[1:])

        def gather(out: memoryview) -> None:  # the run's pages, gathered straight into the message
            torch.index_select(layer, 0, run.src_pages, out=torch.frombuffer(out, dtype=layer.dtype).view(shape))
        return encode_chunk_into(header, len(run.src_pages) * route.sender.pool.layout.page_bytes, gather)

    def _items(self):
        route = self.route
        pool, sender_id, ack_every = route.sender.pool, route.sender.sender_id, route.ack_every
        since_ack = 0
        while not route.stopped.is_set():
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
                yield encode_final(pb.FinalNotice(request_id=route.request_id, sender_id=sender_id,
                                                  first_token=item.first_token, prompt_len=item.prompt_len))
                return
            layer = pool.layers[item]
            for i, run in enumerate(route.runs):
                if not self._permit():
                    return
                last = i == len(route.runs) - 1
                since_ack += 1
                defer = not last and since_ack < ack_every
                if not defer:
                    since_ack = 0
                header = pb.PageChunk(request_id=route.request_id, sender_id=sender_id, layer=item,
                                      token_start=run.token_start, num_tokens=run.num_tokens,
                                      dst_page_ids=run.dst_page_ids, whole_pages=route.whole_pages, defer_ack=defer)
                wire = self._encode(header, layer, run)
                self.inflight.append((item, last))
                yield wire

    def _acks(self) -> None:
        route = self.route
        book, rid = route.sender.book, route.request_id
        try:
            for ack in self.call:
                if not ack.ok:
                    book.fail(rid, f"receiver {route.dest.endpoint} refused: {ack.reason}")
                    return
                for _ in range(max(1, ack.items)):
                    what = self.inflight.popleft()
                    self.permits.release()
                    if what is None:
                        book.mark_final_sent(rid, route.index)
                    elif what[1]:
                        book.confirm(rid, route.index, what[0])
        except grpc.RpcError as exc:
            book.fail(rid, f"stream to {route.dest.endpoint} broke: {_describe(exc)}")
        except Exception as exc:  # keep a bug visible as a failed request, never a hang
            log.exception("kv grpc ack reader")
            book.fail(rid, f"ack reader crashed: {exc}")


class _Route:
    """One request's way to one destination: its runs (planned once) and its lanes."""

    def __init__(self, sender: GrpcSender, request_id: str, index: int, dest: DestinationDescriptor,
                 src_pages: np.ndarray, deadline: float, peer) -> None:
        self.sender, self.request_id, self.index, self.dest = sender, request_id, index, dest
        self.src_pages, self.deadline, self.peer = src_pages, deadline, peer
        self.stopped = threading.Event()
        src, dst = sender.pool.layout, dest.layout
        self.whole_pages = is_homogeneous(src, dst)
        dst_pages = dest.page_array()
        self.runs = [_Run(start, n, torch.from_numpy(pages_of_run(src_pages, src.page_size, start, n).astype(np.int64)),
                          pages_of_run(dst_pages, dst.page_size, start, n).tolist())
                     for start, n in plan_runs(dest.num_tokens, src, dst, sender.config.chunk_bytes)]
        self.ack_every = max(1, sender.config.max_inflight_chunks // 2)
        self.lanes: list[_Lane] = []
        for i in range(min(sender.config.grpc_streams, src.num_layers)):
            self.lanes.append(_Lane(self, i))

    def send_layer(self, layer: int) -> None:
        self.lanes[layer % len(self.lanes)].work.put(layer)

    def finish(self, final: _Final) -> None:
        # One final notice, on lane 0. The other lanes end when the request is DONE here, which
        # is after the receiver is DONE (every layer and the final acknowledged), so their clean
        # ends never look like a sender gone before its final notice.
        self.lanes[0].work.put(final)

    def stop(self, cancel: bool) -> None:
        self.stopped.set()
        for lane in self.lanes:
            lane.work.put(None)
            if cancel:
                lane.call.cancel()  # the receiver sees the stream break and frees its pages


class GrpcSender(KVSender):
    transport = "grpc"

    def __init__(self, pool: KVPool, config: TransferConfig | None = None,
                 on_release: SenderReleaseFn | None = None) -> None:
        super().__init__(pool, config or TransferConfig(), on_release)
        if self.config.grpc_tune_malloc:
            keep_message_buffers(self.config.chunk_bytes)
        self._peers = PeerSet(self.config)
        self._routes: dict[str, list[_Route]] = {}
        self.book.on_end = self._on_end
        self._reaper = Ticker("kv-grpc-send-reaper", self._reap, 0.02)

    def _reap(self) -> bool:
        self.book.reap()
        return False

    def _on_end(self, request_id: str) -> None:
        status = self.book.status(request_id)
        for route in self._routes.pop(request_id, []):
            route.stop(cancel=status is None or status.state != TransferState.DONE)

    def start(self, request_id: str, dests: list[DestinationDescriptor], src_pages: list[int],
              num_tokens: int) -> TransferStatus:
        out = self.book.start(request_id, src_pages, num_tokens, dests, self.config.deadline_s,
                              self.pool.layout.page_size)
        routes: list[_Route] = []
        self._routes[request_id] = routes
        try:
            for i, dest in enumerate(dests):
                if dest.transport != self.transport:
                    raise HandshakeError(f"destination {dest.endpoint} speaks {dest.transport!r}, not grpc")
                peer = self._peers.get(dest.endpoint, lambda: make_request(
                    self.pool.spec, self.pool.layout, self.transport, self.sender_id))
                peer.begin(pb.BeginTransfer(request_id=request_id, sender_id=self.sender_id,
                                            src_page_ids=out.src_pages.tolist(), dst_page_ids=list(dest.page_ids),
                                            num_tokens=num_tokens))
                routes.append(_Route(self, request_id, i, dest, out.src_pages, out.deadline, peer))
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
        for route in self._routes.get(request_id, []):
            route.send_layer(layer)

    def finish(self, request_id: str, first_token: int, prompt_len: int) -> None:
        out = self.book.live(request_id)
        missing = set(range(self.pool.layout.num_layers)) - out.layers_sent
        if missing:
            raise ValueError(f"finish({request_id!r}) before layers {sorted(missing)[:8]} were sent")
        for route in self._routes.get(request_id, []):
            route.finish(_Final(first_token, prompt_len))

    def close(self) -> None:
        self._reaper.stop()
        for rid in self.book.active_ids():
            self.book.fail(rid, "sender closed")
        self._peers.close()
