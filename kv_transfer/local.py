"""Same-process transport (colocated prefill+decode, unit tests): the sender copies each
layer's runs straight into the receiver's pages on send_layer, through the same
handshake, validation and ledgers as the remote transports.

Lifecycle: LocalReceiver registers itself in a LocalHub under "local://<id>"; a
LocalSender on the same hub handshakes with it in-process, begins, copies layer by
layer, and delivers the final notice; both sides then report DONE.
"""
from __future__ import annotations

import threading

from kv_transfer.base import KVReceiver, KVSender, Ticker
from kv_transfer.config import TransferConfig
from kv_transfer.descriptor import DestinationDescriptor
from kv_transfer.handshake import HandshakeError, answer, make_request
from kv_transfer.layout import KVLayout, KVPool
from kv_transfer.mapping import pages_of_run, plan_runs, read_token_run, write_token_run
from kv_transfer.receiver_book import DoneFn, ReleaseFn, TransferRejected
from kv_transfer.sender_book import SenderReleaseFn
from kv_transfer.states import TransferState, TransferStatus


class LocalHub:
    """Receivers of one process by endpoint; pass the same hub to both sides."""

    def __init__(self) -> None:
        self._receivers: dict[str, LocalReceiver] = {}
        self._lock = threading.Lock()

    def add(self, receiver: LocalReceiver) -> None:
        with self._lock:
            self._receivers[receiver.endpoint] = receiver

    def remove(self, endpoint: str) -> None:
        with self._lock:
            self._receivers.pop(endpoint, None)

    def get(self, endpoint: str) -> LocalReceiver:
        with self._lock:
            if endpoint not in self._receivers:
                raise HandshakeError(f"no local receiver at {endpoint}")
            return self._receivers[endpoint]


class LocalReceiver(KVReceiver):
    transport = "local"

    def __init__(self, pool: KVPool, config: TransferConfig | None = None, on_release: ReleaseFn | None = None,
                 hub: LocalHub | None = None, on_done: DoneFn | None = None) -> None:
        super().__init__(pool, config or TransferConfig(), on_release, on_done)
        if hub is None:
            raise ValueError("LocalReceiver needs hub=LocalHub() shared with its senders")
        self.hub = hub
        self.senders: dict[str, KVLayout] = {}
        hub.add(self)
        self._reaper = Ticker("kv-local-reaper", self._reap, 0.02)

    @property
    def endpoint(self) -> str:
        return f"local://{self.receiver_id}"

    def _reap(self) -> bool:
        self.book.reap()
        return False

    def close(self) -> None:
        self._reaper.stop()
        self.hub.remove(self.endpoint)
        for rid in self.book.active_ids():
            self.book.fail(rid, "receiver closed")


class LocalSender(KVSender):
    transport = "local"

    def __init__(self, pool: KVPool, config: TransferConfig | None = None, on_release: SenderReleaseFn | None = None,
                 hub: LocalHub | None = None) -> None:
        super().__init__(pool, config or TransferConfig(), on_release)
        if hub is None:
            raise ValueError("LocalSender needs hub=LocalHub() shared with its receivers")
        self.hub = hub
        self._dests: dict[str, list[LocalReceiver]] = {}
        self.book.on_end = lambda rid: self._dests.pop(rid, None)

    def start(self, request_id: str, dests: list[DestinationDescriptor], src_pages: list[int],
              num_tokens: int) -> TransferStatus:
        out = self.book.start(request_id, src_pages, num_tokens, dests, self.config.deadline_s,
                              self.pool.layout.page_size)
        receivers = []
        try:
            for dest in dests:
                receiver = self.hub.get(dest.endpoint)
                reply = answer(make_request(self.pool.spec, self.pool.layout, self.transport, self.sender_id),
                               receiver.pool.spec, receiver.pool.layout, receiver.transport, receiver.receiver_id,
                               receiver.config.allowed_dtype_conversions)
                if not reply.accepted:
                    raise HandshakeError(f"handshake with {dest.endpoint} refused: {reply.reason}")
                receiver.book.begin(request_id, self.sender_id, self.pool.layout, list(dest.page_ids), num_tokens)
                receivers.append(receiver)
        except (HandshakeError, TransferRejected) as exc:
            self.book.fail(request_id, str(exc))
            return out.status
        self._dests[request_id] = receivers
        self.book.advance(request_id, TransferState.WAITING)
        return out.status

    def send_layer(self, request_id: str, layer: int) -> None:
        self._check_layer(layer)
        out = self.book.live(request_id)
        if layer in out.layers_sent:
            raise ValueError(f"layer {layer} of {request_id!r} was already sent")
        out.layers_sent.add(layer)
        self.book.advance(request_id, TransferState.TRANSFERRING)
        for i, (receiver, dest) in enumerate(zip(self._dests.get(request_id, []), out.dests)):
            dst_pages = dest.page_array()
            try:
                for start, n in plan_runs(out.num_tokens, self.pool.layout, dest.layout, self.config.chunk_bytes):
                    claimed = pages_of_run(dst_pages, dest.layout.page_size, start, n).tolist()
                    inc = receiver.book.check_run(request_id, self.sender_id, layer, start, n, claimed)
                    data = read_token_run(self.pool.layers[layer], out.src_pages, self.pool.layout, start, n)
                    write_token_run(receiver.pool.layers[layer], inc.page_ids, receiver.pool.layout, start, data,
                                    self.pool.layout)
                    receiver.book.mark(request_id, self.sender_id, layer, start, n)
            except TransferRejected as exc:
                self.book.fail(request_id, f"receiver {dest.endpoint} refused: {exc}")
                return
            self.book.confirm(request_id, i, layer)

    def finish(self, request_id: str, first_token: int, prompt_len: int) -> None:
        out = self.book.live(request_id)
        missing = set(range(self.pool.layout.num_layers)) - out.layers_sent
        if missing:
            raise ValueError(f"finish({request_id!r}) before layers {sorted(missing)[:8]} were sent")
        for i, receiver in enumerate(self._dests.get(request_id, [])):
            try:
                receiver.book.final(request_id, self.sender_id, first_token, prompt_len)
            except TransferRejected as exc:
                self.book.fail(request_id, str(exc))
                return
            self.book.mark_final_sent(request_id, i)

    def close(self) -> None:
        for rid in self.book.active_ids():
            self.book.fail(rid, "sender closed")
