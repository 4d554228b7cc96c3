"""The receiver's ledger: which destination pages belong to which request, what has
arrived, and the checks every incoming message passes before a byte is written.

Lifecycle of a request on the decode side:
  expect() allocates nothing itself: the decode worker hands in the pages it allocated,
  state BOOTSTRAPPING, bounded by the begin timeout (the sender may still be queued behind
  other work: a prefill pool's queue is not a transfer); begin() from each sender (after its
  handshake) -> WAITING, and the transfer deadline runs from the first begin;
  check_run() + mark() per written run -> TRANSFERRING; all layers x tokens x held heads
  written and a final notice in -> DONE, announced by `on_done(request_id)`; the worker then
  take()s the request (its pages are the worker's to decode from). A `partial` expectation
  (a prefix fetch: the holder may have fewer pages than asked for) lets the first begin()
  claim a leading part of the pages, whole pages only: the request then covers just those
  tokens. On FAILED (deadline, peer death, rejected message,
  cancel) the ledger calls `on_release(request_id, pages)` once no write into those pages
  is still in flight, so a late write can never land in a page the pool reused.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kv_transfer.layout import KVLayout, KVPool
from kv_transfer.mapping import head_overlap, is_homogeneous, pages_of_run
from kv_transfer.states import TransferState, TransferStatus

log = logging.getLogger(__name__)

ReleaseFn = Callable[[str, list[int]], None]
DoneFn = Callable[[str], None]


class TransferRejected(ValueError):
    """A sender's message failed validation; the request has been failed."""


@dataclass(slots=True)
class Incoming:
    status: TransferStatus
    page_ids: np.ndarray
    num_tokens: int
    deadline: float                          # begin timeout until a sender begins, then the transfer's
    transfer_s: float                        # the transfer deadline, applied from the first begin()
    covered: np.ndarray                      # bool [layers, tokens, held heads]
    remaining: int
    senders: dict[str, KVLayout] = field(default_factory=dict)
    finals: set[str] = field(default_factory=set)  # senders whose final notice arrived
    writers: int = 0                         # writes/reads into these pages still in flight
    released: bool = False
    partial: bool = False                    # the first begin may claim a leading part of the pages


class ReceiverBook:
    def __init__(self, pool: KVPool, on_release: ReleaseFn | None = None, on_done: DoneFn | None = None,
                 history: int = 4096) -> None:
        self.pool = pool
        self.layout = pool.layout
        self._on_release = on_release
        self._on_done = on_done
        self._lock = threading.RLock()
        self._active: dict[str, Incoming] = {}
        self._history: OrderedDict[str, TransferStatus] = OrderedDict()
        self._history_len = history
        self.before_release: Callable[[str], None] | None = None  # transport hook: cancel in-flight ops

    # ---- allocation -------------------------------------------------------------------------
    def expect(self, request_id: str, page_ids: list[int], num_tokens: int, deadline_s: float,
               begin_timeout_s: float | None = None, partial: bool = False) -> TransferStatus:
        """Track `page_ids` for `request_id`. A sender must begin within `begin_timeout_s`
        (default: `deadline_s`), and the whole transfer then finish within `deadline_s` of that
        first begin; either expiry fails the request and releases its pages. `partial`: the
        sender may send fewer tokens, whole pages from the first (module docstring)."""
        pages = np.asarray(page_ids, dtype=np.int64)
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        need = self.layout.pages_for(num_tokens)
        if pages.ndim != 1 or len(pages) < need:
            raise ValueError(f"page_ids: {num_tokens} tokens need {need} pages of {self.layout.page_size}, "
                             f"got {len(pages)}")
        if len(pages) and (pages.min() < 0 or pages.max() >= self.pool.num_pages):
            raise ValueError(f"page_ids must lie in [0, {self.pool.num_pages})")
        if len(np.unique(pages)) != len(pages):
            raise ValueError("page_ids must be distinct")
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"request_id {request_id!r} is already being received")
            busy = self.tracked_pages()
            if busy and np.isin(pages, np.asarray(busy)).any():
                raise ValueError("page_ids overlap pages of another request in flight")
            shape = (self.layout.num_layers, num_tokens, self.layout.num_heads)
            wait = deadline_s if begin_timeout_s is None else begin_timeout_s
            status = TransferStatus(request_id, signal_on_terminal=False)
            self._active[request_id] = Incoming(status, pages, num_tokens, time.monotonic() + wait, deadline_s,
                                                np.zeros(shape, dtype=bool), int(np.prod(shape)), partial=partial)
            return self._active[request_id].status

    def tracked_pages(self) -> list[int]:
        with self._lock:
            return [int(p) for inc in self._active.values() for p in inc.page_ids]

    def get(self, request_id: str) -> Incoming | None:
        with self._lock:
            return self._active.get(request_id)

    def status(self, request_id: str) -> TransferStatus | None:
        with self._lock:
            inc = self._active.get(request_id)
            return inc.status if inc is not None else self._history.get(request_id)

    # ---- validation of what senders send ----------------------------------------------------
    def _reject(self, request_id: str, reason: str) -> TransferRejected:
        log.warning("kv receive %s rejected: %s", request_id, reason)
        self.fail(request_id, f"rejected: {reason}")
        return TransferRejected(reason)

    def _live(self, request_id: str) -> Incoming:
        inc = self._active.get(request_id)
        if inc is None:
            log.warning("kv receive: message for unknown request %r dropped", request_id)
            raise TransferRejected(f"unknown request {request_id!r}")
        if inc.status.state.terminal:
            raise TransferRejected(f"request {request_id!r} is already {inc.status.state.name}")
        return inc

    def begin(self, request_id: str, sender_id: str, sender_layout: KVLayout, dst_page_ids: list[int],
              num_tokens: int | None = None) -> Incoming:
        """`num_tokens`: what the sender's Begin says it sends (a partial request is cut to it)."""
        with self._lock:
            inc = self._live(request_id)
            claimed = np.asarray(dst_page_ids, dtype=np.int64)
            outside = np.setdiff1d(claimed, inc.page_ids)
            if len(outside):
                raise self._reject(request_id, f"page ids {outside[:8].tolist()} are outside the request's allocation")
            if inc.partial and not inc.senders and num_tokens is not None and num_tokens < inc.num_tokens:
                self._cut(request_id, inc, claimed, num_tokens)
            if len(claimed) != len(inc.page_ids) or not np.array_equal(claimed, inc.page_ids):
                raise self._reject(request_id, "dst_page_ids differ from the published descriptor")
            lo, hi = head_overlap(sender_layout, self.layout)
            if lo >= hi:
                raise self._reject(request_id, "sender holds none of the receiver's heads")
            if not inc.senders:  # the first sender: from here on the transfer deadline applies
                inc.deadline = time.monotonic() + inc.transfer_s
            inc.senders[sender_id] = sender_layout
            inc.status.advance(TransferState.WAITING)
            return inc

    def _cut(self, request_id: str, inc: Incoming, claimed: np.ndarray, num_tokens: int) -> None:
        """A partial request's first sender sends only its first `num_tokens` (whole pages)."""
        n = len(claimed)
        if (num_tokens < 1 or num_tokens % self.layout.page_size or self.layout.pages_for(num_tokens) != n
                or not np.array_equal(claimed, inc.page_ids[:n])):
            raise self._reject(request_id, f"a partial begin must claim the first whole pages of the descriptor: "
                                           f"{n} pages for {num_tokens} tokens")
        inc.page_ids, inc.num_tokens = inc.page_ids[:n], num_tokens
        inc.covered = np.ascontiguousarray(inc.covered[:, :num_tokens])
        inc.remaining = int(inc.covered.size)

    def check_run(self, request_id: str, sender_id: str, layer: int, token_start: int, num_tokens: int,
                  dst_page_ids: list[int] | None = None, nbytes: int | None = None,
                  whole_pages: bool = False) -> Incoming:
        """Validate one run and count it as an in-flight write (end it with mark() or abort_write()).
        `whole_pages`: the payload is the sender's whole pages (identical layouts only), so
        `nbytes` must be the pages' size rather than the tokens'."""
        with self._lock:
            inc = self._live(request_id)
            src = inc.senders.get(sender_id)
            if src is None:
                raise self._reject(request_id, f"sender {sender_id!r} did not begin this request")
            if not 0 <= layer < self.layout.num_layers:
                raise self._reject(request_id, f"layer {layer} outside [0, {self.layout.num_layers})")
            if num_tokens < 1 or token_start < 0 or token_start + num_tokens > inc.num_tokens:
                raise self._reject(request_id, f"tokens [{token_start}, {token_start + num_tokens}) outside "
                                               f"[0, {inc.num_tokens})")
            expected = pages_of_run(inc.page_ids, self.layout.page_size, token_start, num_tokens)
            if dst_page_ids is not None:
                claimed = np.asarray(dst_page_ids, dtype=np.int64)
                if not np.array_equal(claimed, expected):  # equal to the expected pages: inside the allocation
                    outside = np.setdiff1d(claimed, inc.page_ids)
                    if len(outside):
                        raise self._reject(request_id, f"page ids {outside[:8].tolist()} are outside the "
                                                       f"request's allocation")
                    raise self._reject(request_id, f"page ids {claimed[:8].tolist()} do not hold tokens "
                                                   f"[{token_start}, {token_start + num_tokens})")
            if whole_pages:
                if not is_homogeneous(src, self.layout):
                    raise self._reject(request_id, "whole-page chunk between different layouts")
                if token_start % self.layout.page_size:
                    raise self._reject(request_id, f"whole-page chunk starts mid-page (token {token_start})")
                want = len(expected) * src.page_bytes
            else:
                want = 2 * num_tokens * src.token_bytes
            if nbytes is not None and nbytes != want:
                raise self._reject(request_id, f"chunk carries {nbytes} bytes, expected {want}")
            lo, hi = head_overlap(src, self.layout)
            h0, h1 = lo - self.layout.head_start, hi - self.layout.head_start
            if inc.covered[layer, token_start:token_start + num_tokens, h0:h1].any():
                raise self._reject(request_id, f"layer {layer} tokens [{token_start}, {token_start + num_tokens}) "
                                               f"heads [{lo}, {hi}) written twice")
            inc.writers += 1
            return inc

    def mark(self, request_id: str, sender_id: str, layer: int, token_start: int, num_tokens: int) -> None:
        """A validated run has landed in the destination pages."""
        with self._lock:
            inc = self._active.get(request_id)
            if inc is None:
                return
            inc.writers -= 1
            if inc.status.state.terminal:
                self._maybe_release(request_id, inc)
                return
            lo, hi = head_overlap(inc.senders[sender_id], self.layout)
            cells = inc.covered[layer, token_start:token_start + num_tokens,
                                lo - self.layout.head_start:hi - self.layout.head_start]
            inc.remaining -= int(cells.size - np.count_nonzero(cells))
            cells[...] = True
            inc.status.advance(TransferState.TRANSFERRING)
            self._maybe_done(inc)

    def abort_write(self, request_id: str, reason: str) -> None:
        with self._lock:
            inc = self._active.get(request_id)
            if inc is not None:
                inc.writers -= 1
        self.fail(request_id, reason)
        self.end_write(request_id, counted=False)

    def end_write(self, request_id: str, counted: bool = True) -> None:
        """A write stopped without landing (cancelled); release pages if the request failed."""
        with self._lock:
            inc = self._active.get(request_id)
            if inc is None:
                return
            if counted:
                inc.writers -= 1
            if inc.status.state == TransferState.FAILED:
                self._maybe_release(request_id, inc)

    def final(self, request_id: str, sender_id: str, first_token: int, prompt_len: int) -> None:
        with self._lock:
            inc = self._live(request_id)
            if sender_id not in inc.senders:
                raise self._reject(request_id, f"final notice from {sender_id!r}, which did not begin")
            if inc.finals and inc.status.first_token != first_token:
                raise self._reject(request_id, "senders disagree on the first token")
            inc.finals.add(sender_id)
            inc.status.first_token, inc.status.prompt_len = first_token, prompt_len
            self._maybe_done(inc)

    def has_final(self, request_id: str, sender_id: str) -> bool:
        """The sender's final notice arrived (or the request is no longer being received)."""
        with self._lock:
            inc = self._active.get(request_id)
            return inc is None or inc.status.state.terminal or sender_id in inc.finals

    def _maybe_done(self, inc: Incoming) -> None:
        # every sender that began must have sent its final notice (TP senders each send one)
        if inc.remaining == 0 and inc.writers == 0 and inc.finals and inc.finals >= inc.senders.keys():
            if inc.status.advance(TransferState.DONE):
                inc.status.finish()  # the pages stay with the request until take()
                if self._on_done is not None:
                    self._on_done(inc.status.request_id)

    # ---- endings ----------------------------------------------------------------------------
    def fail(self, request_id: str, reason: str) -> None:
        with self._lock:
            inc = self._active.get(request_id)
            if inc is None or not inc.status.fail(reason):
                return
            log.warning("kv receive %s FAILED: %s", request_id, reason)
        if self.before_release is not None:
            self.before_release(request_id)
        with self._lock:
            self._maybe_release(request_id, inc)

    def _maybe_release(self, request_id: str, inc: Incoming) -> None:
        if inc.released or inc.writers > 0:
            return
        inc.released = True
        self._retire(request_id)
        try:
            if self._on_release is not None:
                self._on_release(request_id, inc.page_ids.tolist())
        finally:
            inc.status.finish()  # wait() returns FAILED only once the pages are released

    def _retire(self, request_id: str) -> None:
        inc = self._active.pop(request_id)
        self._history[request_id] = inc.status
        while len(self._history) > self._history_len:
            self._history.popitem(last=False)

    def take(self, request_id: str) -> TransferStatus:
        """Hand a DONE request's pages to the worker: the ledger stops tracking them."""
        with self._lock:
            inc = self._active.get(request_id)
            if inc is None or inc.status.state != TransferState.DONE:
                raise ValueError(f"request {request_id!r} is not DONE")
            self._retire(request_id)
            return inc.status

    def reap(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [(rid, bool(inc.senders)) for rid, inc in self._active.items()
                       if not inc.status.state.terminal and now > inc.deadline]
            stuck = [(rid, inc) for rid, inc in self._active.items() if inc.status.state.terminal]
        for rid, begun in expired:
            self.fail(rid, "deadline exceeded" if begun else "begin deadline exceeded: no sender began in time")
        with self._lock:
            for rid, inc in stuck:
                if inc.status.state == TransferState.FAILED:
                    self._maybe_release(rid, inc)

    def active_ids(self) -> list[str]:
        with self._lock:
            return list(self._active)
