"""NIXL transport, sender side. The sender never writes remote memory: it exposes its
registered pool to each receiver in the handshake, announces each finished layer with a
NIXL notification, and the receiver reads it (see nixl_receiver.py).

Lifecycle per request: start() pins the source pages and, per destination, handshakes
(once per endpoint: compat hash, the sender's NIXL metadata and pool addresses; the
receiver answers with its connection info) and sends Begin (WAITING) -> send_layer()
notifies LayerReady (TRANSFERRING) -> each receiver's READ completion arrives as a
LayerRead notification -> finish() sends the final notice -> every layer read by every
destination: DONE, pages unpinned. An Abort from a receiver, a failed notification (a
liveness probe every `liveness_interval_s` while requests are in flight) or the deadline ->
FAILED (receivers are told), pages unpinned.
"""
from __future__ import annotations

import logging
import time

from kv_transfer.base import KVSender, Ticker
from kv_transfer.config import TransferConfig
from kv_transfer.descriptor import DestinationDescriptor
from kv_transfer.handshake import HandshakeError, make_request
from kv_transfer.layout import KVPool
from kv_transfer.nixl_pool import NixlPoolAgent
from kv_transfer.sender_book import SenderReleaseFn
from kv_transfer.service import PeerSet
from kv_transfer.states import TransferState, TransferStatus
from proto.pdcluster.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

PARKED_POLL_S = 0.02  # poll period with no request in flight (deadlines are still reaped this often)


class NixlSender(KVSender):
    transport = "nixl"

    def __init__(self, pool: KVPool, config: TransferConfig | None = None,
                 on_release: SenderReleaseFn | None = None) -> None:
        super().__init__(pool, config or TransferConfig(), on_release)
        self.nixl = NixlPoolAgent(self.sender_id, pool, 0, self.config.ucx_net_devices)
        self._peers = PeerSet(self.config)
        self._agents: dict[str, str] = {}             # endpoint -> receiver agent name
        self._dest_agents: dict[str, list[str]] = {}  # request -> receiver agent per destination
        self._next_probe = 0.0
        self.book.on_end = self._on_end
        self._progress = Ticker("kv-nixl-send", self._tick, self.config.nixl_sender_poll_s, PARKED_POLL_S,
                                active=lambda: bool(self._dest_agents), backoff_max_s=self.config.poll_backoff_max_s)

    def _handshake(self, endpoint: str) -> str:
        peer = self._peers.get(endpoint, lambda: make_request(self.pool.spec, self.pool.layout, self.transport,
                                                               self.sender_id, self.nixl.pool_info()))
        if endpoint not in self._agents:
            self._agents[endpoint] = self.nixl.add_remote(peer.reply.nixl_conn_metadata)
        return self._agents[endpoint]

    def start(self, request_id: str, dests: list[DestinationDescriptor], src_pages: list[int],
              num_tokens: int) -> TransferStatus:
        out = self.book.start(request_id, src_pages, num_tokens, dests, self.config.deadline_s,
                              self.pool.layout.page_size)
        agents: list[str] = []
        self._dest_agents[request_id] = agents
        try:
            for dest in dests:
                if dest.transport != self.transport:
                    raise HandshakeError(f"destination {dest.endpoint} speaks {dest.transport!r}, not nixl")
                agent = self._handshake(dest.endpoint)
                self._peers.get(dest.endpoint, None).begin(pb.BeginTransfer(
                    request_id=request_id, sender_id=self.sender_id, src_page_ids=out.src_pages.tolist(),
                    dst_page_ids=list(dest.page_ids), num_tokens=num_tokens))
                agents.append(agent)
        except HandshakeError as exc:
            self.book.fail(request_id, str(exc))
            return out.status
        self.book.advance(request_id, TransferState.WAITING)
        self._progress.wake()
        return out.status

    def _notify_all(self, request_id: str, message: pb.NixlNotice) -> bool:
        for agent in self._dest_agents.get(request_id, []):
            if not self.nixl.notify(agent, message):
                self.book.fail(request_id, f"notification to receiver {agent} failed")
                return False
        return True

    def send_layer(self, request_id: str, layer: int) -> None:
        self._check_layer(layer)
        out = self.book.live(request_id)
        if layer in out.layers_sent:
            raise ValueError(f"layer {layer} of {request_id!r} was already sent")
        out.layers_sent.add(layer)
        self.book.advance(request_id, TransferState.TRANSFERRING)
        self._notify_all(request_id, pb.NixlNotice(layer_ready=pb.LayerReady(
            request_id=request_id, sender_id=self.sender_id, layer=layer)))

    def finish(self, request_id: str, first_token: int, prompt_len: int) -> None:
        out = self.book.live(request_id)
        missing = set(range(self.pool.layout.num_layers)) - out.layers_sent
        if missing:
            raise ValueError(f"finish({request_id!r}) before layers {sorted(missing)[:8]} were sent")
        if self._notify_all(request_id, pb.NixlNotice(final=pb.FinalNotice(
                request_id=request_id, sender_id=self.sender_id, first_token=first_token, prompt_len=prompt_len))):
            for i in range(len(out.dests)):
                self.book.mark_final_sent(request_id, i)

    def _tick(self) -> bool:
        busy = False
        for agent, msg in self.nixl.notifications():
            busy = True
            kind = msg.WhichOneof("kind")
            if kind == "layer_read":
                rid = msg.layer_read.request_id
                agents = self._dest_agents.get(rid, [])
                for i, name in enumerate(agents):
                    if name == agent:
                        self.book.confirm(rid, i, msg.layer_read.layer)
            elif kind == "abort":
                self.book.fail(msg.abort.request_id, f"receiver {agent} aborted: {msg.abort.reason}")
            else:
                log.warning("nixl: unexpected %s notification from %s dropped", kind, agent)
        self._probe_receivers()
        self.book.reap()
        return busy

    def _probe_receivers(self) -> None:
        """Fail the requests bound for a receiver whose process is gone (it would never read
        them), without waiting for the deadline."""
        interval = self.config.liveness_interval_s
        now = time.monotonic()
        if not interval or now < self._next_probe:
            return
        self._next_probe = now + interval
        requests = list(self._dest_agents.items())
        for agent in {a for _, agents in requests for a in agents}:
            if not self.nixl.probe(agent):
                for rid, agents in requests:
                    if agent in agents:
                        self.book.fail(rid, f"receiver {agent} unreachable: its NIXL agent disconnected")

    def _on_end(self, request_id: str) -> None:
        status = self.book.status(request_id)
        agents = self._dest_agents.pop(request_id, [])
        if status is not None and status.state == TransferState.FAILED:
            for agent in agents:  # best effort; the receiver's own deadline covers a lost notice
                self.nixl.notify(agent, pb.NixlNotice(abort=pb.Abort(request_id=request_id,
                                                                    reason=status.error or "failed")))

    def close(self) -> None:
        for rid in self.book.active_ids():
            self.book.fail(rid, "sender closed")
        self._progress.stop()
        self._peers.close()
        self.nixl.close()
