"""The sender's ledger: which source pages are pinned by which outgoing request.

Lifecycle of a request on the prefill side: start() pins the source pages (BOOTSTRAPPING)
while the transport handshakes with each destination; begun -> WAITING; the first
send_layer -> TRANSFERRING; every layer confirmed by every destination and the final
notice sent -> DONE. DONE or FAILED calls `on_release(request_id, pages, state)` once, when
no byte of those pages can still be read, so the worker may free or cache them; `wait()`
returns a terminal state only after that call.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kv_transfer.descriptor import DestinationDescriptor
from kv_transfer.states import TransferState, TransferStatus

log = logging.getLogger(__name__)

SenderReleaseFn = Callable[[str, list[int], TransferState], None]


@dataclass(slots=True)
class Outgoing:
    status: TransferStatus
    src_pages: np.ndarray
    num_tokens: int
    dests: list[DestinationDescriptor]
    deadline: float
    layers_sent: set[int] = field(default_factory=set)
    confirmed: np.ndarray | None = None      # bool [dests, layers]: destination has the layer
    finals: np.ndarray | None = None         # bool [dests]: final notice delivered
    released: bool = False


class SenderBook:
    def __init__(self, num_layers: int, num_pages: int, on_release: SenderReleaseFn | None = None,
                 history: int = 4096) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self._on_release = on_release
        self._lock = threading.RLock()
        self._active: dict[str, Outgoing] = {}
        self._history: OrderedDict[str, TransferStatus] = OrderedDict()
        self._history_len = history
        self.on_end: Callable[[str], None] | None = None  # transport hook: stop streams (must not block)

    def start(self, request_id: str, src_pages: list[int], num_tokens: int,
              dests: list[DestinationDescriptor], deadline_s: float, page_size: int) -> Outgoing:
        pages = np.asarray(src_pages, dtype=np.int64)
        need = -(-num_tokens // page_size)
        if num_tokens < 1 or len(pages) < need:
            raise ValueError(f"src_pages: {num_tokens} tokens need {need} pages, got {len(pages)}")
        if len(pages) and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise ValueError(f"src_pages must lie in [0, {self.num_pages})")
        if not dests:
            raise ValueError("dests must name at least one destination")
        for d in dests:
            if d.num_tokens != num_tokens:
                raise ValueError(f"destination {d.endpoint} expects {d.num_tokens} tokens, sender has {num_tokens}")
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"request_id {request_id!r} is already being sent")
            out = Outgoing(TransferStatus(request_id, signal_on_terminal=False), pages[:need], num_tokens, list(dests),
                           time.monotonic() + deadline_s,
                           confirmed=np.zeros((len(dests), self.num_layers), dtype=bool),
                           finals=np.zeros(len(dests), dtype=bool))
            self._active[request_id] = out
            return out

    def get(self, request_id: str) -> Outgoing | None:
        with self._lock:
            return self._active.get(request_id)

    def live(self, request_id: str) -> Outgoing:
        with self._lock:
            out = self._active.get(request_id)
            if out is None or out.status.state.terminal:
                state = "unknown" if out is None else out.status.state.name
                raise ValueError(f"request {request_id!r} is not being sent ({state})")
            return out

    def status(self, request_id: str) -> TransferStatus | None:
        with self._lock:
            out = self._active.get(request_id)
            return out.status if out is not None else self._history.get(request_id)

    def tracked_pages(self) -> list[int]:
        with self._lock:
            return [int(p) for out in self._active.values() for p in out.src_pages]

    def advance(self, request_id: str, state: TransferState) -> None:
        if state.terminal:
            raise ValueError(f"advance moves to a non-terminal state; {state.name} goes through confirm/fail")
        with self._lock:
            out = self._active.get(request_id)
            if out is not None:
                out.status.advance(state)

    def confirm(self, request_id: str, dest_index: int, layer: int) -> None:
        with self._lock:
            out = self._active.get(request_id)
            if out is None or out.status.state.terminal:
                return
            out.confirmed[dest_index, layer] = True
            self._maybe_done(request_id, out)

    def mark_final_sent(self, request_id: str, dest_index: int) -> None:
        with self._lock:
            out = self._active.get(request_id)
            if out is not None and not out.status.state.terminal:
                out.finals[dest_index] = True
                self._maybe_done(request_id, out)

    def _maybe_done(self, request_id: str, out: Outgoing) -> None:
        if out.finals.all() and out.confirmed.all() and out.status.advance(TransferState.DONE):
            self._release(request_id, out)

    def fail(self, request_id: str, reason: str) -> None:
        with self._lock:
            out = self._active.get(request_id)
            if out is None or not out.status.fail(reason):
                return
            log.warning("kv send %s FAILED: %s", request_id, reason)
            self._release(request_id, out)

    def _release(self, request_id: str, out: Outgoing) -> None:
        if out.released:
            return
        out.released = True
        if self.on_end is not None:
            self.on_end(request_id)
        self._active.pop(request_id, None)
        self._history[request_id] = out.status
        while len(self._history) > self._history_len:
            self._history.popitem(last=False)
        try:
            if self._on_release is not None:
                self._on_release(request_id, out.src_pages.tolist(), out.status.state)
        finally:
            out.status.finish()  # wait() returns only once the pages are released

    def reap(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [rid for rid, out in self._active.items() if now > out.deadline]
        for rid in expired:
            self.fail(rid, "deadline exceeded")

    def active_ids(self) -> list[str]:
        with self._lock:
            return list(self._active)
