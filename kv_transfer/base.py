"""The transfer contract both worker roles program against.

Decode side (owns destination pages):
    receiver = create_receiver("nixl", pool, config, on_release=free_pages, on_done=arrived)
    desc = receiver.expect(request_id, page_ids, num_tokens)   # publish desc to the router
    status = receiver.wait(request_id, timeout)                # or wait for on_done(request_id)
    receiver.take(request_id)                                  # DONE: pages are the worker's
Prefill side (owns source pages):
    sender = create_sender("nixl", pool, config, on_release=unpin_pages)
    sender.start(request_id, [desc], src_page_ids, num_tokens)
    for layer in ...: sender.send_layer(request_id, layer)     # as each layer's KV is ready
    sender.finish(request_id, first_token, prompt_len)
Either side's request ends DONE or FAILED (states.py); on FAILED both ledgers give the pages
back through `on_release`, within the configured deadline at the latest.
"""
from __future__ import annotations

import logging
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable

from kv_transfer.config import TransferConfig
from kv_transfer.descriptor import DestinationDescriptor
from kv_transfer.handshake import CompatInfo
from kv_transfer.layout import KVPool
from kv_transfer.receiver_book import DoneFn, ReceiverBook, ReleaseFn
from kv_transfer.sender_book import SenderBook, SenderReleaseFn
from kv_transfer.states import TransferStatus

log = logging.getLogger(__name__)


class Ticker:
    """A daemon thread calling `fn` until stopped; `fn` returns True when it did work. Idle,
    it sleeps `idle_s`, or `parked_s` while `active()` says nothing is in flight: a parked
    poller leaves the CPU (and the GIL) to the rest of the process, and `wake()` ends the
    sleep when work arrives. With `backoff_max_s`, each idle tick in a row doubles the sleep
    from `idle_s` up to that bound, and a busy tick or a `wake()` puts it back to `idle_s`: a
    request in flight whose next event is a long prefill away then costs ~250 wake-ups a
    second instead of 2,000."""

    def __init__(self, name: str, fn: Callable[[], bool], idle_s: float, parked_s: float | None = None,
                 active: Callable[[], bool] | None = None, backoff_max_s: float | None = None) -> None:
        self._fn, self._idle_s, self._active = fn, idle_s, active
        self._parked_s = idle_s if parked_s is None else parked_s
        self._backoff_max_s = max(idle_s, backoff_max_s or idle_s)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        sleep_s = self._idle_s
        while not self._stop.is_set():
            try:
                busy = self._fn()
            except Exception:  # a bug in one tick must not stop progress (and the deadline reaper) for good
                log.exception("%s: tick failed", self._thread.name)
                busy = False
            if busy:
                sleep_s = self._idle_s
                continue
            parked = self._active is not None and not self._active()
            if self._wake.wait(self._parked_s if parked else sleep_s):
                sleep_s = self._idle_s
            else:
                sleep_s = min(2 * sleep_s, self._backoff_max_s)
            self._wake.clear()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class KVReceiver(ABC):
    transport: str = ""

    def __init__(self, pool: KVPool, config: TransferConfig, on_release: ReleaseFn | None = None,
                 on_done: DoneFn | None = None) -> None:
        self.pool, self.config = pool, config
        self.book = ReceiverBook(pool, on_release, on_done)
        self.receiver_id = f"recv-{uuid.uuid4().hex[:12]}"
        self.compat = CompatInfo.of(pool.spec, pool.layout)

    @property
    @abstractmethod
    def endpoint(self) -> str: ...

    def expect(self, request_id: str, page_ids: list[int], num_tokens: int,
               deadline_s: float | None = None, begin_timeout_s: float | None = None,
               partial: bool = False) -> DestinationDescriptor:
        """Track pages the worker allocated for a request and publish where to send them. A
        sender has `begin_timeout_s` (config default) to begin, then `deadline_s` to finish.
        `partial`: the sender may fill only the first whole pages (a prefix fetch; receiver_book.py)."""
        self.book.expect(request_id, page_ids, num_tokens, deadline_s or self.config.deadline_s,
                         begin_timeout_s or self.config.begin_timeout_s, partial)
        return DestinationDescriptor(request_id, self.transport, self.endpoint, tuple(int(p) for p in page_ids),
                                     num_tokens, self.pool.layout, self.compat)

    def status(self, request_id: str) -> TransferStatus | None:
        return self.book.status(request_id)

    def wait(self, request_id: str, timeout: float | None = None) -> TransferStatus:
        status = self.book.status(request_id)
        if status is None:
            raise KeyError(f"unknown request {request_id!r}")
        status.wait(timeout)
        return status

    def take(self, request_id: str) -> TransferStatus:
        return self.book.take(request_id)

    def cancel(self, request_id: str, reason: str = "cancelled by the receiver") -> None:
        self.book.fail(request_id, reason)

    def tracked_pages(self) -> list[int]:
        return self.book.tracked_pages()

    def transfers_in_flight(self) -> int:
        """Transfers this receiver still works on (its poller runs at full rate while any do)."""
        return 0

    @abstractmethod
    def close(self) -> None: ...


class KVSender(ABC):
    transport: str = ""

    def __init__(self, pool: KVPool, config: TransferConfig, on_release: SenderReleaseFn | None = None) -> None:
        self.pool, self.config = pool, config
        self.book = SenderBook(pool.layout.num_layers, pool.num_pages, on_release)
        self.sender_id = f"send-{uuid.uuid4().hex[:12]}"

    @abstractmethod
    def start(self, request_id: str, dests: list[DestinationDescriptor], src_pages: list[int],
              num_tokens: int) -> TransferStatus:
        """Handshake with each destination (cached per endpoint) and pin the source pages."""

    @abstractmethod
    def send_layer(self, request_id: str, layer: int) -> None:
        """Layer `layer` of this request is computed: move it (returns without waiting)."""

    @abstractmethod
    def finish(self, request_id: str, first_token: int, prompt_len: int) -> None:
        """All layers sent: deliver the first sampled token and the prompt length."""

    def status(self, request_id: str) -> TransferStatus | None:
        return self.book.status(request_id)

    def wait(self, request_id: str, timeout: float | None = None) -> TransferStatus:
        status = self.book.status(request_id)
        if status is None:
            raise KeyError(f"unknown request {request_id!r}")
        status.wait(timeout)
        return status

    def cancel(self, request_id: str, reason: str = "cancelled by the sender") -> None:
        self.book.fail(request_id, reason)

    def tracked_pages(self) -> list[int]:
        return self.book.tracked_pages()

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.pool.layout.num_layers:
            raise ValueError(f"layer must be in [0, {self.pool.layout.num_layers}), got {layer}")

    @abstractmethod
    def close(self) -> None: ...
