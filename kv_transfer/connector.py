"""`TransferConnector`: the engine's KV connector (engine/kv_connector.py) over one transport
(nixl, grpc or local). A prefill worker's connector sends, a decode worker's receives; the
engine calls it and never sees a transport.

Sending (a request with `kv_destinations`, the receivers' descriptors):
    start_save (its last prompt chunk is scheduled) -> sender.start, pages pinned
    save_layer(i) during that step's forward -> sender.send_layer for each save started this step
    finish_save (first token sampled) -> sender.finish(first token, prompt length)
    the request finishes: its pages stay held -> sender's on_release (DONE or FAILED) -> RELEASED
Receiving (pages allocated by the engine for a request waiting for remote KV):
    prepare_receive -> receiver.expect: the descriptor the sender needs
    receiver's on_done (every layer and the final notice in) -> take_events: receiver.take, the
        pages are the engine's again -> RECEIVED with the first token
    receiver's on_release (FAILED: deadline, peer loss, a rejected write, a cancel; no write in
        flight any more) -> FAILED
    the request ends before its KV came (abort) -> receiver.cancel; its pages stay held until
        the release, unless nothing was in flight

Prefix fetch (a connector with both roles), the wire id `prefix_transfer_id(request id)`:
    requester: prepare_fetch -> receiver.expect(partial=True, begin deadline = the transfer
        deadline): the descriptor the holder needs -> on_done -> PREFIX_RECEIVED with the tokens
        that came (the holder may send fewer whole pages) | on_release -> FAILED
    holder: start_export -> sender.start into the destinations cut to the tokens it holds, every
        layer at once, finish (no first token: -1) -> on_release -> RELEASED

The transport's callbacks run on its own threads: they only queue an event and call the
engine's wake-up. Events carry the engine's `Request` object, so an event that comes after its
request ended never touches a later request with the same id.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable

from engine.kv_connector import KVConnector, KVEvent, KVEventKind, prefix_transfer_id
from engine.request import Request
from kv_transfer.base import KVReceiver, KVSender
from kv_transfer.config import TransferConfig
from kv_transfer.descriptor import DestinationDescriptor
from kv_transfer.layout import KVPool
from kv_transfer.registry import create_receiver, create_sender
from kv_transfer.states import TransferState

_DONE = object()  # a receive reported DONE, to be taken on the engine thread
_FETCHED = object()  # a prefix fetch reported DONE, likewise
NO_FIRST_TOKEN = -1  # an export's final notice: a prefix has no sampled token


class TransferConnector(KVConnector):
    def __init__(self, transport: str, config: TransferConfig | None = None, *, model_id: str,
                 send: bool = False, receive: bool = False, transport_kwargs: dict | None = None) -> None:
        if not (send or receive):
            raise ValueError("a TransferConnector sends, receives or both: set send or receive")
        self.transport, self.config, self.model_id = transport, config or TransferConfig(), model_id
        self._roles = (send, receive)
        self._transport_kwargs = transport_kwargs or {}
        self.pool: KVPool | None = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._lock = threading.Lock()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup: Callable[[], None] = lambda: None
        self._sending: dict[str, Request] = {}    # send started, source pages not released yet
        self._this_step: list[Request] = []       # sends started by this step's schedule
        self._receiving: dict[str, Request] = {}  # descriptor published, KV not taken or failed yet
        self._fetching: dict[str, Request] = {}   # prefix fetches by transfer id, likewise

    def register_kv_caches(self, kv_caches: list, *, head_start: int = 0, num_kv_heads: int | None = None,
                           tp_size: int = 1, tp_rank: int = 0) -> None:
        """`head_start`, `num_kv_heads`, `tp_size`, `tp_rank`: a tensor-parallel rank's first KV
        head, the model's total (its caches hold only its own heads) and its place in the group
        (the handshake checks the heads are that rank's)."""
        self.pool = KVPool.from_tensors(kv_caches, self.model_id, head_start=head_start, num_kv_heads=num_kv_heads,
                                        tp_size=tp_size, tp_rank=tp_rank)
        send, receive = self._roles
        if send:
            self.sender = create_sender(self.transport, self.pool, self.config, on_release=self._send_released,
                                        **self._transport_kwargs)
        if receive:
            self.receiver = create_receiver(self.transport, self.pool, self.config, on_release=self._receive_failed,
                                            on_done=self._received, **self._transport_kwargs)

    @property
    def prefix_fetch(self) -> bool:
        return all(self._roles)

    @property
    def roles(self) -> tuple[bool, bool]:
        """(sends, receives)."""
        return self._roles

    @property
    def transport_kwargs(self) -> dict:
        return self._transport_kwargs

    @property
    def endpoint(self) -> str:
        """Where senders reach this connector's receiver."""
        if self.receiver is None:
            raise ValueError("this connector does not receive")
        return self.receiver.endpoint

    # ---- scheduler side ---------------------------------------------------------------------
    def check(self, req: Request) -> None:
        if self.sender is None:
            raise ValueError("this worker does not send KV: kv_destinations are not accepted")
        for d in req.kv_destinations:
            if not isinstance(d, DestinationDescriptor):
                raise ValueError(f"kv_destinations must be DestinationDescriptors, got {type(d).__name__}")
            if d.num_tokens != req.num_prompt_tokens:
                raise ValueError(f"destination {d.endpoint} expects {d.num_tokens} tokens, the prompt has "
                                 f"{req.num_prompt_tokens}")

    def start_save(self, req: Request, dests: list[DestinationDescriptor] | None = None) -> str | None:
        """`dests`: where this connector sends (default: all of `req.kv_destinations`; a
        tensor-parallel rank sends its share)."""
        rid = req.request_id
        with self._lock:
            self._sending[rid] = req  # before start: a failed handshake may release at once
        dests = list(req.kv_destinations) if dests is None else list(dests)
        try:
            status = self.sender.start(rid, dests, list(req.pages), req.num_prompt_tokens)
        except Exception as exc:  # a refused start leaves nothing tracked
            with self._lock:
                self._sending.pop(rid, None)
            return f"transfer start failed: {type(exc).__name__}: {exc}"
        if status.state == TransferState.FAILED:
            return status.error or "transfer failed at start"
        self._this_step.append(req)
        return None

    def prepare_receive(self, req: Request) -> DestinationDescriptor:
        if self.receiver is None:
            raise ValueError("this worker does not receive KV")
        rid = req.request_id
        with self._lock:
            self._receiving[rid] = req
        try:
            # the prompt's KV, and a resumed request's output tokens' too (all it holds before its first step)
            return self.receiver.expect(rid, list(req.pages), req.num_tokens)
        except BaseException:
            with self._lock:
                self._receiving.pop(rid, None)
            raise

    def request_finished(self, req: Request) -> bool:
        rid = req.request_id
        if req in self._this_step:
            self._this_step.remove(req)
        with self._lock:
            if self._sending.get(rid) is req:
                return True  # source pages are read until the send ends
            if self._receiving.get(rid) is req:
                book = self._receiving
            elif self._fetching.get(tid := prefix_transfer_id(rid)) is req:
                book, rid = self._fetching, tid
            else:
                return False
        self.receiver.cancel(rid, "the request ended before its KV arrived")
        status = self.receiver.status(rid)
        if status is not None and status.state == TransferState.DONE:
            self.receiver.take(rid)  # it arrived just before the end: the pages are free to reuse
            with self._lock:
                book.pop(rid, None)
            return False
        with self._lock:  # still receiving: a write may be in flight until the release
            return book.get(rid) is req

    def cancel(self, req: Request) -> None:
        """Stop the transfer of a request whose pages the engine holds for this connector."""
        if self.sender is not None:
            self.sender.cancel(req.request_id, "cancelled by the sender's caller")

    # ---- prefix fetch -----------------------------------------------------------------------
    def prepare_fetch(self, req: Request, pages: list[int], num_tokens: int) -> DestinationDescriptor:
        if not self.prefix_fetch:
            raise ValueError("a prefix fetch needs a connector that both sends and receives")
        tid = prefix_transfer_id(req.request_id)
        with self._lock:
            self._fetching[tid] = req
        try:  # the holder answers at once, so it has the transfer deadline to begin, not a queue's
            return self.receiver.expect(tid, list(pages), num_tokens, begin_timeout_s=self.config.deadline_s,
                                        partial=True)
        except BaseException:
            with self._lock:
                self._fetching.pop(tid, None)
            raise

    def cancel_fetch(self, req: Request) -> None:
        tid = prefix_transfer_id(req.request_id)
        with self._lock:
            fetching = self._fetching.get(tid) is req
        if fetching:
            self.receiver.cancel(tid, "the fetch was abandoned")

    def start_export(self, req: Request, dests: list, num_tokens: int) -> str | None:
        tid = req.request_id
        if not self.prefix_fetch:
            error = "a prefix export needs a connector that both sends and receives"
        else:
            error = _check_export(tid, dests, num_tokens, self.pool.layout.page_size)
        if error is not None:
            self._queue(KVEventKind.RELEASED, req)
            return error
        dests = [d if d.num_tokens == num_tokens else
                 dataclasses.replace(d, num_tokens=num_tokens, page_ids=d.page_ids[:len(req.pages)]) for d in dests]
        with self._lock:
            clash = tid in self._sending
            if not clash:
                self._sending[tid] = req
        if clash:
            self._queue(KVEventKind.RELEASED, req)
            return f"transfer {tid!r} is already being sent"
        try:
            status = self.sender.start(tid, dests, list(req.pages), num_tokens)
            if status.state != TransferState.FAILED:
                for layer in range(self.pool.layout.num_layers):
                    self.sender.send_layer(tid, layer)
                self.sender.finish(tid, NO_FIRST_TOKEN, num_tokens)
        except Exception as exc:  # a refused start or a send that ended meanwhile: its pages come back
            self.sender.cancel(tid, f"export failed: {exc}")
            with self._lock:
                untracked = self._sending.pop(tid, None) is req
            if untracked:  # the sender never tracked it: nobody else will release it
                self._queue(KVEventKind.RELEASED, req)
            return f"export failed: {type(exc).__name__}: {exc}"
        if status.state == TransferState.FAILED:
            return status.error or "export failed at start"
        return None

    # ---- worker side ------------------------------------------------------------------------
    def save_layer(self, layer: int) -> None:
        for req in self._this_step:
            status = self.sender.status(req.request_id)
            if status is not None and not status.state.terminal:
                self.sender.send_layer(req.request_id, layer)

    def finish_save(self, req: Request, first_token: int) -> str | None:
        if req in self._this_step:
            self._this_step.remove(req)
        status = self.sender.status(req.request_id)
        if status is not None and not status.state.terminal:
            self.sender.finish(req.request_id, first_token, req.num_prompt_tokens)
        if status is None or status.state == TransferState.FAILED:
            return (status.error if status is not None else None) or "KV transfer failed"
        return None

    def take_events(self) -> list[KVEvent]:
        events = []
        while True:
            try:
                kind, req, error = self._events.get_nowait()
            except queue.Empty:
                return events
            if kind is _FETCHED:
                ev = self._take_fetch(req)
                if ev is not None:
                    events.append(ev)
                continue
            if kind is not _DONE:
                events.append(KVEvent(kind, req, error=error))
                continue
            rid = req.request_id
            with self._lock:
                if self._receiving.get(rid) is not req:
                    continue  # it ended meanwhile (request_finished took or cancelled it)
                del self._receiving[rid]
            status = self.receiver.take(rid)
            if status.prompt_len != req.num_tokens or status.first_token is None:
                events.append(KVEvent(KVEventKind.FAILED, req, error=f"final notice says prompt_len="
                                      f"{status.prompt_len}, expected {req.num_tokens}"))
            else:
                events.append(KVEvent(KVEventKind.RECEIVED, req, first_token=status.first_token))

    def _take_fetch(self, req: Request) -> KVEvent | None:
        tid = prefix_transfer_id(req.request_id)
        with self._lock:
            if self._fetching.get(tid) is not req:
                return None  # it ended meanwhile
            del self._fetching[tid]
        inc = self.receiver.book.get(tid)
        written = inc.num_tokens if inc is not None else 0  # what the ledger saw written (a cut receive: fewer)
        status = self.receiver.take(tid)
        if status.prompt_len != written or not written or written % self.pool.layout.page_size:
            return KVEvent(KVEventKind.FAILED, req, error=f"prefix fetch: the final notice says {status.prompt_len} "
                                                           f"tokens, {written} were written")
        return KVEvent(KVEventKind.PREFIX_RECEIVED, req, num_tokens=written)

    @property
    def has_events(self) -> bool:
        return not self._events.empty()

    def set_wakeup(self, fn: Callable[[], None]) -> None:
        self._wakeup = fn

    @property
    def saving_this_step(self) -> bool:
        return bool(self._this_step)

    def is_sending(self, request_id: str) -> bool:
        """Whether a send of the request still holds its source pages."""
        with self._lock:
            return request_id in self._sending

    def is_receiving(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._receiving or prefix_transfer_id(request_id) in self._fetching

    @property
    def tracking(self) -> dict[str, int]:
        """Transfers this connector tracks now, by kind (all 0 when it is idle)."""
        with self._lock:
            return {"sending": len(self._sending), "receiving": len(self._receiving),
                    "fetching": len(self._fetching)}

    @property
    def num_sending(self) -> int:
        with self._lock:
            return len(self._sending)

    def close(self) -> None:
        """Fail every transfer in flight; their pages come back through the usual events."""
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()

    # ---- transport threads ------------------------------------------------------------------
    def _send_released(self, request_id: str, pages: list[int], state: TransferState) -> None:
        with self._lock:
            req = self._sending.pop(request_id, None)
        if req is not None:
            self._queue(KVEventKind.RELEASED, req)

    def _received(self, request_id: str) -> None:
        with self._lock:
            req = self._receiving.get(request_id)
            fetch = self._fetching.get(request_id)
        if req is not None:
            self._queue(_DONE, req)
        elif fetch is not None:
            self._queue(_FETCHED, fetch)

    def _receive_failed(self, request_id: str, pages: list[int]) -> None:
        with self._lock:
            req = self._receiving.pop(request_id, None) or self._fetching.pop(request_id, None)
        if req is not None:
            status = self.receiver.status(request_id)
            self._queue(KVEventKind.FAILED, req, (status.error if status is not None else None) or "transfer failed")

    def _queue(self, kind, req: Request, error: str | None = None) -> None:
        self._events.put((kind, req, error))
        self._wakeup()


def _check_export(transfer_id: str, dests: list, num_tokens: int, page_size: int) -> str | None:
    """Why these destinations cannot take `num_tokens` of an export, or None."""
    if not dests:
        return "an export needs at least one destination"
    for d in dests:
        if not isinstance(d, DestinationDescriptor):
            return f"destinations must be DestinationDescriptors, got {type(d).__name__}"
        if d.request_id != transfer_id:
            return f"destination {d.endpoint} is for transfer {d.request_id!r}, not {transfer_id!r}"
        if d.layout.page_size != page_size:
            return (f"destination {d.endpoint} has pages of {d.layout.page_size} tokens, this worker {page_size}: a "
                    f"prefix moves between equal page sizes")
        if not 0 < num_tokens <= d.num_tokens or num_tokens % page_size:
            return f"cannot send {num_tokens} tokens into a destination of {d.num_tokens} (whole pages only)"
    return None
