"""NIXL transport, receiver side. The receiver *pulls*: it issues NIXL READs from the
sender's registered pages into its own pages, so only the receiver ever writes its KV
pool and the pool is never exposed to peers (they get connection info only).

Lifecycle per request: expect() (BOOTSTRAPPING) -> sender Handshake over gRPC carrying
its NIXL metadata and pool addresses (compat checked first; the sender's page list is
prepared once per sender) -> Begin (dst page ids checked against the allocation, source
pages recorded; WAITING) -> per layer a LayerReady notification -> READs of the ready layers
(TRANSFERRING: one READ for consecutive layers ready together before the first READ lands, a
prepared READ per layer after it), whose completion notifies the sender (LayerRead per layer)
-> all layers read and the final notice in -> DONE. A failed read, an abort notice, a cancel, a
sender found gone by the liveness probe (an empty notice every `liveness_interval_s`, which
fails at once when the peer process has died) or the deadline -> FAILED: in-flight reads are cancelled (or waited out, up to a grace
period), the sender is told, and the pages are released.

Descriptor set-up and coalescing: identical layouts read page-to-page (one descriptor per
(layer, page), merged by NIXL where adjacent); layers ready together before the first READ
lands go as one READ, later ones by READs prepared in one pass; see nixl_reads.py.

Layouts:
Different page sizes, head ranges or dtypes read the sender's whole pages into a
registered staging buffer, then re-lay them out locally (mapping.write_token_run); see
the package README note in the final report for why.
"""
from __future__ import annotations

import logging
import time
from collections import deque

import grpc
import numpy as np

from kv_transfer.base import KVReceiver, Ticker
from kv_transfer.config import TransferConfig
from kv_transfer.handshake import answer
from kv_transfer.layout import KVLayout, KVPool
from kv_transfer.mapping import cast_view, is_homogeneous, write_token_run
from kv_transfer.nixl_pool import NixlPoolAgent, PeerPool
from kv_transfer.nixl_reads import PreparedReads, Read, Source, SourceKey
from kv_transfer.receiver_book import DoneFn, ReleaseFn, TransferRejected
from kv_transfer.service import serve
from proto.pdcluster.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 2.0
PARKED_POLL_S = 0.02  # poll period with no request begun (deadlines are still reaped this often)


class NixlReceiver(KVReceiver):
    transport = "nixl"

    def __init__(self, pool: KVPool, config: TransferConfig | None = None, on_release: ReleaseFn | None = None,
                 on_done: DoneFn | None = None) -> None:
        super().__init__(pool, config or TransferConfig(), on_release, on_done)
        self.nixl = NixlPoolAgent(self.receiver_id, pool, self.config.staging_bytes,
                                  self.config.ucx_net_devices)
        self._peers: dict[str, PeerPool] = {}                         # sender_id -> its pool
        self.reads = PreparedReads(self.nixl)                         # (request, sender) -> its pages, READs
        self._to_prepare: deque[SourceKey] = deque()                  # sources begun, READs not yet made
        self._queue: deque[Read] = deque()                            # reads not yet posted
        self._inflight: list[Read] = []
        self._staged: Read | None = None                              # the staging buffer's one user
        self._cancelled: deque[str] = deque()
        self.setup_s, self.setup_wall_s = self.reads.setup_s, self.reads.setup_wall_s  # per request (bench)
        self._next_probe = 0.0
        self.book.before_release = self._on_failed
        self._server, self._port = serve(self, self.config)
        self._progress = Ticker("kv-nixl-recv", self._tick, self.config.poll_interval_s, PARKED_POLL_S,
                                active=lambda: bool(self.reads.sources or self._inflight or self._cancelled),
                                backoff_max_s=self.config.poll_backoff_max_s)

    def _on_failed(self, request_id: str) -> None:
        self._cancelled.append(request_id)
        self._progress.wake()

    @property
    def endpoint(self) -> str:
        return f"{self.config.host}:{self._port}"

    # ---- control service --------------------------------------------------------------------
    def handle_handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeReply:
        reply = answer(request, self.pool.spec, self.pool.layout, self.transport, self.receiver_id,
                       self.config.allowed_dtype_conversions)
        if reply.accepted and not request.HasField("nixl"):
            reply.accepted, reply.reason = False, "nixl handshake without the sender's pool info"
        if reply.accepted:
            try:
                self._peers[request.sender_id] = self.nixl.add_peer_pool(request.nixl,
                                                                         KVLayout.from_proto(request.layout))
            except Exception as exc:
                reply.accepted, reply.reason = False, f"could not load the sender's NIXL metadata: {exc}"
        if not reply.accepted:
            log.warning("kv handshake from %s refused: %s", request.sender_id, reply.reason)
            return reply
        reply.nixl_agent_name = self.nixl.name
        reply.nixl_conn_metadata = self.nixl.conn_metadata()
        return reply

    def handle_begin(self, request: pb.BeginTransfer) -> pb.Ack:
        peer = self._peers.get(request.sender_id)
        if peer is None:
            return pb.Ack(ok=False, reason=f"sender {request.sender_id!r} has not handshaken")
        src = np.asarray(request.src_page_ids, dtype=np.int64)
        if len(src) < peer.layout.pages_for(request.num_tokens) or (len(src) and (
                src.min() < 0 or src.max() >= peer.num_pages)):
            return pb.Ack(ok=False, reason="src_page_ids do not cover the tokens or lie outside the sender's pool")
        try:
            inc = self.book.begin(request.request_id, request.sender_id, peer.layout, list(request.dst_page_ids),
                                  request.num_tokens)
        except TransferRejected as exc:
            return pb.Ack(ok=False, reason=str(exc))
        if request.num_tokens != inc.num_tokens:
            self.book.fail(request.request_id, "begin: token count differs from the descriptor")
            return pb.Ack(ok=False, reason="num_tokens differs from the descriptor")
        n = peer.layout.pages_for(inc.num_tokens)
        key = (request.request_id, request.sender_id)
        self.reads.sources[key] = Source(src[:n], inc.page_ids[:n], is_homogeneous(peer.layout, self.pool.layout),
                                         self.pool.layout.num_layers)
        if not self.config.nixl_coalesce_reads:
            self._to_prepare.append(key)  # every layer its own READ, prepared now (nixl_reads.py)
        self._progress.wake()
        return pb.Ack(ok=True)

    def handle_cancel(self, request: pb.Abort) -> pb.Ack:
        self.book.fail(request.request_id, f"cancelled by sender: {request.reason}")
        return pb.Ack(ok=True)

    def handle_push(self, items, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this receiver speaks nixl, not grpc chunks")

    # ---- progress thread --------------------------------------------------------------------
    def _tick(self) -> bool:
        busy = False
        while self._to_prepare:
            self._prepare(self._to_prepare.popleft())
            busy = True
        for peer_name, msg in self.nixl.notifications():
            busy = True
            self._on_notice(peer_name, msg)
        busy |= self._post_reads()
        busy |= self._poll_reads()
        while self._cancelled:
            self._cancel(self._cancelled.popleft())
        self._probe_senders()
        self.book.reap()
        # with no NIXL progress thread, UCX moves bytes inside check_xfer_state: keep polling
        # while reads are in flight instead of sleeping
        return busy or bool(self._inflight)

    def _probe_senders(self) -> None:
        """Fail the requests of a sender whose process is gone, without waiting for the deadline."""
        interval = self.config.liveness_interval_s
        now = time.monotonic()
        if not interval or now < self._next_probe:
            return
        self._next_probe = now + interval
        keys = list(self.reads.sources)
        for sender_id in {sid for _, sid in keys}:
            peer = self._peers.get(sender_id)
            if peer is not None and not self.nixl.probe(peer.agent_name):
                for rid, sid in keys:
                    if sid == sender_id:
                        self.book.fail(rid, f"sender {sender_id} unreachable: its NIXL agent disconnected")

    def _on_notice(self, peer_name: str, msg: pb.NixlNotice) -> None:
        kind = msg.WhichOneof("kind")
        try:
            if kind == "layer_ready":
                note = msg.layer_ready
                self._plan_layer(note.request_id, note.sender_id, note.layer)
            elif kind == "final":
                f = msg.final
                self.book.final(f.request_id, f.sender_id, f.first_token, f.prompt_len)
                self._forget_if_finished(f.request_id)  # the last READ may have landed before this notice
            elif kind == "abort":
                self.book.fail(msg.abort.request_id, f"aborted by sender: {msg.abort.reason}")
            else:
                log.warning("nixl: unexpected %s notification from %s dropped", kind, peer_name)
        except TransferRejected:
            pass  # logged and failed by the ledger

    def _prepare(self, key: SourceKey) -> None:
        try:
            self.reads.prepare(key, self._peers[key[1]])
        except Exception as exc:
            self.book.fail(key[0], f"nixl could not prepare reads: {exc}")

    def _plan_layer(self, request_id: str, sender_id: str, layer: int) -> None:
        source = self.reads.sources.get((request_id, sender_id))
        inc = self.book.get(request_id)
        if source is None or inc is None:
            log.warning("nixl: layer %d for unknown request %s from %s dropped", layer, request_id, sender_id)
            return
        src = source.src_pages
        peer = self._peers[sender_id]
        if source.homogeneous:
            self._queue.append(Read(request_id, sender_id, layer, 0, inc.num_tokens))
            return
        slots, _ = self.nixl.staging_slots(peer.layout.page_bytes)
        if slots == 0:
            self.book.fail(request_id, f"staging buffer ({self.config.staging_bytes} bytes) smaller than one sender "
                                       f"page ({peer.layout.page_bytes} bytes)")
            return
        ps = peer.layout.page_size
        for a in range(0, len(src), slots):
            b = min(a + slots, len(src))
            start, end = a * ps, min(b * ps, inc.num_tokens)
            self._queue.append(Read(request_id, sender_id, layer, start, end - start, src[a:b], b == len(src)))

    def _post_reads(self) -> bool:
        posted = False
        while self._queue:
            read = self._queue[0]
            if read.src_pages is not None and self._staged is not None:
                break  # one staged read at a time; page-to-page reads queued behind it wait
            self._queue.popleft()
            if self.book.get(read.request_id) is None:
                continue
            while self.config.nixl_coalesce_reads and self._queue and self.reads.mergeable(read, self._queue[0]):
                read.layers += 1  # the next layer of this source is ready too: one READ for both
                self._queue.popleft()
            self._post(read)
            posted = True
        return posted

    def _post(self, read: Read) -> None:
        rid, counted = read.request_id, 0
        try:
            for layer in range(read.layer, read.layer + read.layers):
                self.book.check_run(rid, read.sender_id, layer, read.token_start, read.num_tokens)
                counted += 1
        except TransferRejected:
            for _ in range(counted):
                self.book.end_write(rid)
            return
        peer = self._peers[read.sender_id]
        last = read.layer + read.layers - 1  # its notice rides on the READ; the others follow at landing
        notif = pb.NixlNotice(layer_read=pb.LayerRead(request_id=rid, layer=last)).SerializeToString() \
            if read.last else b""
        try:
            if read.src_pages is None:
                read.handle = self.reads.take(read, peer)
            else:
                t0, c0 = time.perf_counter(), time.thread_time()
                _, local_list = self.nixl.staging_slots(peer.layout.page_bytes)
                local = np.arange(len(read.src_pages), dtype=np.int32)
                remote = peer.indices(read.layer, read.src_pages)
                self._staged = read
                read.handle = self.nixl.agent.make_prepped_xfer("READ", local_list, local, peer.dlist, remote)
                self.reads.count_setup(rid, time.thread_time() - c0, time.perf_counter() - t0)
            if self.nixl.agent.transfer(read.handle, notif) == "ERR":
                raise RuntimeError("transfer() returned ERR")
        except Exception as exc:
            self._drop(read)
            self._end(read, f"nixl read of layer {read.layer} could not start: {exc}")
            return
        self.reads.count_post(rid)
        self._inflight.append(read)

    def _end(self, read: Read, failure: str | None = None) -> None:
        """A read stopped without landing: end its layers' in-flight writes (failing the
        request with `failure`, if given); pages are released once no write is in flight."""
        for _ in range(read.layers - (failure is not None)):
            self.book.end_write(read.request_id)
        if failure is not None:
            self.book.abort_write(read.request_id, failure)

    def _poll_reads(self) -> bool:
        progressed = False
        still = []
        for read in self._inflight:
            state = self.nixl.agent.check_xfer_state(read.handle)
            if state == "PROC":
                if read.cancel_at is not None and time.monotonic() > read.cancel_at:
                    log.error("nixl read for %s could not be cancelled within %.1fs; releasing its pages",
                              read.request_id, CANCEL_GRACE_S)
                    self._drop(read)
                    self._end(read)
                else:
                    still.append(read)
                continue
            progressed = True
            if state == "DONE" and read.cancel_at is None:
                self._land(read)
            else:
                self._drop(read)
                self._end(read, None if state == "DONE" else f"nixl read of layer {read.layer} failed (peer gone?)")
        self._inflight = still
        return progressed

    def _land(self, read: Read) -> None:
        inc = self.book.get(read.request_id)
        if read.src_pages is not None and inc is not None:
            src_layout = self._peers[read.sender_id].layout
            pages = cast_view(self.nixl.staging, src_layout, len(read.src_pages))
            tokens = pages.transpose(0, 1).reshape(2, -1, src_layout.num_heads, src_layout.head_dim)
            write_token_run(self.pool.layers[read.layer], inc.page_ids, self.pool.layout, read.token_start,
                            tokens[:, :read.num_tokens], src_layout)
        self._drop(read)
        for layer in range(read.layer, read.layer + read.layers):
            self.book.mark(read.request_id, read.sender_id, layer, read.token_start, read.num_tokens)
        if not self._forget_if_finished(read.request_id) and read.src_pages is None:
            self._prepare((read.request_id, read.sender_id))  # the layers still to come (nixl_reads.py)
        if read.layers > 1:  # the READ's own notice confirmed its last layer; confirm the others
            agent = self._peers[read.sender_id].agent_name
            for layer in range(read.layer, read.layer + read.layers - 1):
                self.nixl.notify(agent, pb.NixlNotice(layer_read=pb.LayerRead(request_id=read.request_id,
                                                                              layer=layer)))

    def _forget_if_finished(self, request_id: str) -> bool:
        """Drop the request's sources once it is terminal, whichever event (its last READ landing
        or the sender's final notice) came last: a source left behind keeps the poller from parking."""
        status = self.book.status(request_id)
        if status is None or not status.state.terminal:
            return False
        for key in self.reads.keys_of(request_id):
            self.reads.forget(key)
        return True

    def transfers_in_flight(self) -> int:
        return len({rid for rid, _ in self.reads.sources} | {r.request_id for r in self._inflight})

    def _drop(self, read: Read) -> None:
        if read.handle is not None:
            try:
                self.nixl.agent.release_xfer_handle(read.handle)
            except Exception:
                pass
            read.handle = None
        if self._staged is read:
            self._staged = None

    def _cancel(self, request_id: str) -> None:
        """Progress thread: stop reads of a failed request and tell its senders."""
        self._queue = deque(r for r in self._queue if r.request_id != request_id)
        for read in self._inflight:
            if read.request_id == request_id and read.cancel_at is None:
                read.cancel_at = time.monotonic() + CANCEL_GRACE_S
        for key in self.reads.keys_of(request_id):
            sid = key[1]
            self.reads.forget(key)
            status = self.book.status(request_id)
            reason = status.error if status is not None and status.error else "failed"
            self.nixl.notify(self._peers[sid].agent_name, pb.NixlNotice(abort=pb.Abort(request_id=request_id,
                                                                                      reason=reason)))

    def close(self) -> None:
        self._server.stop(grace=0.5).wait(2)
        for rid in self.book.active_ids():
            self.book.fail(rid, "receiver closed")
        deadline = time.monotonic() + CANCEL_GRACE_S + 0.5
        while (self._inflight or self._cancelled) and time.monotonic() < deadline:
            time.sleep(0.01)
        self._progress.stop()
        for key in list(self.reads.sources):
            self.reads.forget(key)
        for peer in self._peers.values():
            try:
                self.nixl.agent.release_dlist_handle(peer.dlist)
            except Exception:
                pass
        self._peers.clear()
        self.nixl.close()
