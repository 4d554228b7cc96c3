"""NIXL transport, receiver side. The receiver *pulls*: it issues NIXL READs from the
sender's registered pages into its own pages, so only the receiver ever writes its KV
pool and the pool is never exposed to peers (they get connection info only).

Lifecycle per request: expect() (BOOTSTRAPPING) -> sender Handshake over gRPC carrying
its NIXL metadata and pool addresses (compat checked first; the sender's page list is
prepared once per sender) -> Begin (dst page ids checked against the allocation, source
pages recorded; WAITING) -> per layer a LayerReady notification -> one prepared READ
for the layer (TRANSFERRING), whose completion notifies the sender (LayerRead) -> all
layers read and the final notice in -> DONE. A failed read, an abort notice, a cancel, a
sender found gone by the liveness probe (an empty notice every `liveness_interval_s`, which
fails at once when the peer process has died) or the deadline -> FAILED: in-flight reads are cancelled (or waited out, up to a grace
period), the sender is told, and the pages are released.

Descriptor set-up: identical layouts read page-to-page (one descriptor per (layer, page)),
and the request's per-layer prepared READs are all made in one pass on the progress thread
(at its first tick after Begin), so a layer's arrival costs one `transfer()` call. The cost
of making a prepared READ is mostly cache and TLB misses in NIXL's descriptor lists, which
the multi-megabyte reads in between evict: made one at a time as layers arrived, each cost
~30-60 us; made back to back, the whole set costs what a few of those did.

Layouts:
Different page sizes, head ranges or dtypes read the sender's whole pages into a
registered staging buffer, then re-lay them out locally (mapping.write_token_run); see
the package README note in the final report for why.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import grpc
import numpy as np

from kv_transfer.base import KVReceiver, Ticker
from kv_transfer.config import TransferConfig
from kv_transfer.handshake import answer
from kv_transfer.layout import KVLayout, KVPool
from kv_transfer.mapping import cast_view, is_homogeneous, write_token_run
from kv_transfer.nixl_pool import NixlPoolAgent, PeerPool
from kv_transfer.receiver_book import ReleaseFn, TransferRejected
from kv_transfer.service import serve
from proto.pdcluster.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 2.0
PARKED_POLL_S = 0.02  # poll period with no request begun (deadlines are still reaped this often)


@dataclass(slots=True)
class _Source:
    """One sender's pages of one request; for page-to-page reads, one prepared READ per layer
    (None once posted), made in one pass by `_prepare`."""

    src_pages: np.ndarray
    dst_pages: np.ndarray
    homogeneous: bool
    handles: list | None = None


@dataclass(slots=True)
class _Read:
    """One layer (or one staged group of a layer) being read from a sender."""

    request_id: str
    sender_id: str
    layer: int
    token_start: int
    num_tokens: int
    src_pages: np.ndarray | None = None    # staged reads: the sender pages of this group
    last: bool = True                      # the read that confirms the layer to the sender
    handle: object = None
    cancel_at: float | None = None


class NixlReceiver(KVReceiver):
    transport = "nixl"

    def __init__(self, pool: KVPool, config: TransferConfig | None = None, on_release: ReleaseFn | None = None) -> None:
        super().__init__(pool, config or TransferConfig(), on_release)
        self.nixl = NixlPoolAgent(self.receiver_id, pool, self.config.staging_bytes,
                                  self.config.ucx_net_devices)
        self._peers: dict[str, PeerPool] = {}                         # sender_id -> its pool
        self._sources: dict[tuple[str, str], _Source] = {}            # (request, sender) -> its pages
        self._to_prepare: deque[tuple[str, str]] = deque()            # sources begun, READs not yet made
        self._queue: deque[_Read] = deque()                           # reads not yet posted
        self._inflight: list[_Read] = []
        self._staged: _Read | None = None                             # the staging buffer's one user
        self._cancelled: deque[str] = deque()
        # per request (bench): index arrays + prepared-READ creation. setup_s is the progress
        # thread's CPU time, so it counts the set-up work and not time spent descheduled or
        # waiting for the GIL behind the service threads; setup_wall_s is the wall clock.
        self.setup_s: dict[str, float] = {}
        self.setup_wall_s: dict[str, float] = {}
        self._next_probe = 0.0
        self.book.before_release = self._on_failed
        self._server, self._port = serve(self, self.config)
        self._progress = Ticker("kv-nixl-recv", self._tick, self.config.poll_interval_s, PARKED_POLL_S,
                                active=lambda: bool(self._sources or self._inflight or self._cancelled))

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
            inc = self.book.begin(request.request_id, request.sender_id, peer.layout, list(request.dst_page_ids))
        except TransferRejected as exc:
            return pb.Ack(ok=False, reason=str(exc))
        if request.num_tokens != inc.num_tokens:
            self.book.fail(request.request_id, "begin: token count differs from the descriptor")
            return pb.Ack(ok=False, reason="num_tokens differs from the descriptor")
        n = peer.layout.pages_for(inc.num_tokens)
        key = (request.request_id, request.sender_id)
        self._sources[key] = _Source(src[:n], inc.page_ids[:n], is_homogeneous(peer.layout, self.pool.layout))
        self._to_prepare.append(key)
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
        keys = list(self._sources)
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
            elif kind == "abort":
                self.book.fail(msg.abort.request_id, f"aborted by sender: {msg.abort.reason}")
            else:
                log.warning("nixl: unexpected %s notification from %s dropped", kind, peer_name)
        except TransferRejected:
            pass  # logged and failed by the ledger

    def _prepare(self, key: tuple[str, str]) -> None:
        """Make every layer's prepared READ of a page-to-page source, back to back."""
        source = self._sources.get(key)
        if source is None or not source.homogeneous or source.handles is not None:
            return
        peer = self._peers[key[1]]
        t0, c0 = time.perf_counter(), time.thread_time()
        local = self.nixl.index_rows(self.pool.num_pages, source.dst_pages, slot=0)
        remote = self.nixl.index_rows(peer.num_pages, source.src_pages, slot=1)
        handles: list = []
        try:
            for layer in range(self.pool.layout.num_layers):
                handles.append(self.nixl.agent.make_prepped_xfer("READ", self.nixl.local_pages, local[layer],
                                                                 peer.dlist, remote[layer]))
        except Exception as exc:
            self._release_handles(handles)
            self.book.fail(key[0], f"nixl could not prepare reads: {exc}")
            return
        source.handles = handles
        self._count_setup(key[0], time.thread_time() - c0, time.perf_counter() - t0)

    def _count_setup(self, request_id: str, cpu_s: float, wall_s: float) -> None:
        if len(self.setup_s) > 4096:
            self.setup_s.clear()
            self.setup_wall_s.clear()
        self.setup_s[request_id] = self.setup_s.get(request_id, 0.0) + cpu_s
        self.setup_wall_s[request_id] = self.setup_wall_s.get(request_id, 0.0) + wall_s

    def _release_handles(self, handles) -> None:
        for handle in handles:
            if handle is not None:
                try:
                    self.nixl.agent.release_xfer_handle(handle)
                except Exception:
                    pass

    def _forget(self, key: tuple[str, str]) -> None:
        source = self._sources.pop(key, None)
        if source is not None and source.handles:
            self._release_handles(source.handles)  # layers never read: their READs were never posted

    def _plan_layer(self, request_id: str, sender_id: str, layer: int) -> None:
        source = self._sources.get((request_id, sender_id))
        inc = self.book.get(request_id)
        if source is None or inc is None:
            log.warning("nixl: layer %d for unknown request %s from %s dropped", layer, request_id, sender_id)
            return
        src = source.src_pages
        peer = self._peers[sender_id]
        if source.homogeneous:
            self._queue.append(_Read(request_id, sender_id, layer, 0, inc.num_tokens))
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
            self._queue.append(_Read(request_id, sender_id, layer, start, end - start, src[a:b], b == len(src)))

    def _post_reads(self) -> bool:
        posted = False
        while self._queue:
            read = self._queue[0]
            if read.src_pages is not None and self._staged is not None:
                break  # one staged read at a time; page-to-page reads queued behind it wait
            self._queue.popleft()
            if self.book.get(read.request_id) is None:
                continue
            self._post(read)
            posted = True
        return posted

    def _post(self, read: _Read) -> None:
        rid = read.request_id
        try:
            inc = self.book.check_run(rid, read.sender_id, read.layer, read.token_start, read.num_tokens)
        except TransferRejected:
            return
        peer = self._peers[read.sender_id]
        notif = pb.NixlNotice(layer_read=pb.LayerRead(request_id=rid, layer=read.layer)).SerializeToString() \
            if read.last else b""
        try:
            if read.src_pages is None:
                key = (rid, read.sender_id)
                self._prepare(key)  # normally done already, at the first tick after Begin
                handles = self._sources[key].handles
                read.handle, handles[read.layer] = handles[read.layer], None
                if read.handle is None:
                    raise RuntimeError(f"layer {read.layer} has no prepared read (read twice?)")
            else:
                t0, c0 = time.perf_counter(), time.thread_time()
                _, local_list = self.nixl.staging_slots(peer.layout.page_bytes)
                local = np.arange(len(read.src_pages), dtype=np.int32)
                remote = peer.indices(read.layer, read.src_pages)
                self._staged = read
                read.handle = self.nixl.agent.make_prepped_xfer("READ", local_list, local, peer.dlist, remote)
                self._count_setup(rid, time.thread_time() - c0, time.perf_counter() - t0)
            if self.nixl.agent.transfer(read.handle, notif) == "ERR":
                raise RuntimeError("transfer() returned ERR")
        except Exception as exc:
            self._drop(read)
            self.book.abort_write(rid, f"nixl read of layer {read.layer} could not start: {exc}")
            return
        self._inflight.append(read)

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
                    self.book.end_write(read.request_id)
                else:
                    still.append(read)
                continue
            progressed = True
            if state == "DONE" and read.cancel_at is None:
                self._land(read)
            else:
                self._drop(read)
                if state == "DONE":
                    self.book.end_write(read.request_id)
                else:
                    self.book.abort_write(read.request_id, f"nixl read of layer {read.layer} failed (peer gone?)")
        self._inflight = still
        return progressed

    def _land(self, read: _Read) -> None:
        inc = self.book.get(read.request_id)
        if read.src_pages is not None and inc is not None:
            src_layout = self._peers[read.sender_id].layout
            pages = cast_view(self.nixl.staging, src_layout, len(read.src_pages))
            tokens = pages.transpose(0, 1).reshape(2, -1, src_layout.num_heads, src_layout.head_dim)
            write_token_run(self.pool.layers[read.layer], inc.page_ids, self.pool.layout, read.token_start,
                            tokens[:, :read.num_tokens], src_layout)
        self._drop(read)
        self.book.mark(read.request_id, read.sender_id, read.layer, read.token_start, read.num_tokens)
        status = self.book.status(read.request_id)
        if status is not None and status.state.terminal:
            for key in [k for k in list(self._sources) if k[0] == read.request_id]:
                self._forget(key)

    def _drop(self, read: _Read) -> None:
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
        senders = [sid for (rid, sid) in list(self._sources) if rid == request_id]
        for sid in senders:
            self._forget((request_id, sid))
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
        for key in list(self._sources):
            self._forget(key)
        for peer in self._peers.values():
            try:
                self.nixl.agent.release_dlist_handle(peer.dlist)
            except Exception:
                pass
        self._peers.clear()
        self.nixl.close()
