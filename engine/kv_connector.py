"""The KV connector contract: how a request's KV cache leaves this engine for another worker, or
arrives here from one. An engine owns at most one connector (a colocated engine has none); the
prefill, decode and colocated workers run the same `EngineCore` step loop and differ in their
connector and their policies. `kv_transfer.connector` implements it over NIXL, gRPC or local
transports; the engine never imports a transport.

Everything here is called on the engine's thread, except the wake-up, which the connector calls
from whatever thread saw the event.

Set-up
  register_kv_caches(caches) the engine's KV tensors, once, before any request (per layer
                             [num_pages, 2, page_size, kv_heads, head_dim]): a transport registers
                             them where it needs to and never copies them
Tensor parallelism (an engine with tensor_parallel_size > 1 takes only a connector whose
`tensor_parallel` is True: each rank moves its own KV heads; kv_transfer/tp_connector.py)
  follower_config(store) -> dict
                             how each follower builds its rank's end (JSON-able, for its
                             ShardSpec): {"factory": "module:callable", "settings": {...}}; the
                             follower calls factory(settings, rank=, host=, kv_caches=,
                             head_start=, num_kv_heads=, store=, event_store=) and gets an object
                             with handle(command bytes), on_layer() (the forward's callback or
                             None), lock (held around each forward) and close()
                             (engine/tp_worker.py); the engine imports no transport
  join_group(group, shard, num_kv_heads)
                             the leader's TPGroup, once connected, before register_kv_caches
                             Everything below then covers the request on every rank: its event
                             comes once all ranks are done with it.
Scheduler side: what moves, and when pages may be freed
  check(req)                 a request with `kv_destinations` is valid for this connector
                             (raises ValueError naming what is wrong; nothing is kept)
  start_save(req) -> error   the request's last prompt chunk runs this step: start its send
                             (None, or why it could not start: the request then fails)
  prepare_receive(req) -> D  pages are allocated for a request whose prompt KV comes from
                             elsewhere: publish where to write them (D travels to the sender; a
                             tensor-parallel engine's is a list, one descriptor per rank)
  request_finished(req) -> bool
                             the request leaves the engine (finished, aborted or failed): True if
                             the connector still needs its pages (a send or a receive in flight).
                             The engine then holds them until an event for the request arrives.
  cancel(req)                the owner gave up on a request whose pages are held: end its transfer
                             (the pages come back with its event)
Worker side: moving bytes, and what happened
  save_layer(layer)          during the forward, once layer's K/V of this step is written: send it
                             for every save started this step
  finish_save(req, token) -> error
                             after sampling: the first token and the prompt length follow the KV
  take_events() -> [KVEvent] what happened since the last call; the engine drains them at the
                             start of every step
  set_wakeup(fn)             fn() is called after an event is queued, so the engine loop wakes for
                             it: nothing outside the connector polls

Prefix fetch (a worker pulls a cached prefix from a peer's prefix cache instead of computing
it; `prefix_fetch` is True for a connector that can, which needs both roles). The transfer's id
on the wire is `prefix_transfer_id(request id)`, so it never meets the request's own send or
receive.
  prepare_fetch(req, pages, num_tokens) -> D
                             receive up to `num_tokens` (whole pages) of the prompt's KV, from
                             token `req`'s pages before `pages` cover, into `pages`; the holder may
                             send fewer whole pages. Ends with PREFIX_RECEIVED or FAILED, within
                             the transfer deadline (also the deadline for the holder to begin)
  cancel_fetch(req)          give up a fetch (FAILED follows once nothing writes into the pages)
  start_export(req, dests, num_tokens) -> error
                             the holder's side: send the first `num_tokens` of KV held in
                             `req.pages` (cached pages the engine pinned for it; `req` is the
                             engine's record of the export, its id the transfer id) into
                             `dests`, every layer at once, no forward pass; fewer tokens than the
                             destination asked for fill its first pages only. RELEASED(req)
                             always follows, also after an error.

Events
  RECEIVED(req, first_token) every layer of the prompt's KV is in req's pages
  PREFIX_RECEIVED(req, num_tokens)
                             a fetch ended: the first `num_tokens` of the pages it was given hold
                             the prefix's KV (whole pages)
  FAILED(req, error)         the request's transfer failed; nothing writes into its pages any more
  RELEASED(req)              a send ended (done or failed); nothing reads its pages any more
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request


class KVEventKind(enum.Enum):
    RECEIVED = "received"
    PREFIX_RECEIVED = "prefix_received"
    FAILED = "failed"
    RELEASED = "released"


@dataclass(slots=True, frozen=True)
class KVEvent:
    kind: KVEventKind
    request: Request  # the very object the connector was given: a stale event never matches a new request
    first_token: int | None = None
    error: str | None = None
    num_tokens: int | None = None  # PREFIX_RECEIVED: tokens of KV that arrived


def prefix_transfer_id(request_id: str) -> str:
    """The id of a request's prefix fetch on the wire (on both the holder and the requester)."""
    return f"{request_id}#prefix"


class KVConnector(ABC):
    @abstractmethod
    def register_kv_caches(self, kv_caches: list) -> None: ...

    tensor_parallel = False  # True: moves every rank's KV heads (the hooks below)

    def follower_config(self, store) -> dict:
        raise NotImplementedError

    def join_group(self, group, shard, num_kv_heads: int) -> None:
        raise NotImplementedError

    # ---- scheduler side ---------------------------------------------------------------------
    @abstractmethod
    def check(self, req: Request) -> None: ...

    @abstractmethod
    def start_save(self, req: Request) -> str | None: ...

    @abstractmethod
    def prepare_receive(self, req: Request) -> object: ...

    @abstractmethod
    def request_finished(self, req: Request) -> bool: ...

    @abstractmethod
    def cancel(self, req: Request) -> None: ...

    # ---- prefix fetch -----------------------------------------------------------------------
    prefix_fetch = False  # True: prepare_fetch, cancel_fetch and start_export work

    def prepare_fetch(self, req: Request, pages: list[int], num_tokens: int) -> object:
        raise NotImplementedError

    def cancel_fetch(self, req: Request) -> None:
        raise NotImplementedError

    def start_export(self, req: Request, dests: list, num_tokens: int) -> str | None:
        raise NotImplementedError

    # ---- worker side ------------------------------------------------------------------------
    @abstractmethod
    def save_layer(self, layer: int) -> None: ...

    @abstractmethod
    def finish_save(self, req: Request, first_token: int) -> str | None: ...

    @abstractmethod
    def take_events(self) -> list[KVEvent]: ...

    @property
    @abstractmethod
    def has_events(self) -> bool: ...

    @abstractmethod
    def set_wakeup(self, fn: Callable[[], None]) -> None: ...

    @abstractmethod
    def close(self) -> None: ...
