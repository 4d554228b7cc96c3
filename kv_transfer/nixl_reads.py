"""The nixl receiver's page-to-page READs: what it reads from each sender of a request, and
the prepared NIXL transfers that read it (the receiver drives them, nixl_receiver.py).

When READs are made. Layers reach the receiver in one of two patterns: in a burst (the
prefill computed them faster than the receiver polls, or before the transfer began), or one
by one as the prefill computes them. So per (request, sender) source with an identical layout:

- until the source's first READ lands, each poll's run of consecutive ready layers is read by
  one READ made when it is posted (one `make_prepped_xfer` over the run's index rows, a few
  tens of us): a burst costs one or two READs and no set-up for layers read that way;
- once the first READ has landed, one prepared READ per layer not yet read is made, all in one
  pass, so each later layer costs one `transfer()` call. Making prepared READs one at a time
  between multi-megabyte reads cost ~30-60 us each (cache and TLB misses in NIXL's descriptor
  lists, which the reads evict); back to back, the whole set costs what a few of those did.

Coalescing saves per-transfer work (one `transfer()`, completion poll and notification instead
of one per layer), which on a 2-core machine competed with the copy; NIXL merges descriptors
adjacent on both sides, so a layer of consecutive pages is one descriptor either way. With
`TransferConfig.nixl_coalesce_reads` off, every layer is read alone by a READ prepared at
Begin (the earlier scheme, kept to measure against).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kv_transfer.nixl_pool import NixlPoolAgent, PeerPool

SourceKey = tuple[str, str]  # (request id, sender id)


@dataclass(slots=True)
class Source:
    """One sender's pages of one request; for page-to-page reads, which layers have been
    posted and, once prepared, one READ per layer not posted before (None where posted)."""

    src_pages: np.ndarray
    dst_pages: np.ndarray
    homogeneous: bool
    num_layers: int
    handles: list | None = None
    posted: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.posted = np.zeros(self.num_layers, dtype=bool)


@dataclass(slots=True)
class Read:
    """Layers [layer, layer + layers) of one request (or one staged group of a layer) being
    read from a sender. Staged reads always hold one layer."""

    request_id: str
    sender_id: str
    layer: int
    token_start: int
    num_tokens: int
    src_pages: np.ndarray | None = None    # staged reads: the sender pages of this group
    last: bool = True                      # the read that confirms its layers to the sender
    handle: object = None
    cancel_at: float | None = None
    layers: int = 1

    def extends(self, other: Read) -> bool:
        """`other` is the next layer of the same page-to-page source."""
        return (self.src_pages is None and other.src_pages is None and other.request_id == self.request_id
                and other.sender_id == self.sender_id and other.layer == self.layer + self.layers)


class PreparedReads:
    """Sources of the requests in flight and their READs; set-up time per request."""

    def __init__(self, nixl: NixlPoolAgent) -> None:
        self.nixl = nixl
        self.sources: dict[SourceKey, Source] = {}
        # per request (bench): index arrays + READ creation. setup_s is the progress thread's
        # CPU time, so it counts the set-up work and not time spent descheduled or waiting for
        # the GIL behind the service threads; setup_wall_s is the wall clock.
        self.setup_s: dict[str, float] = {}
        self.setup_wall_s: dict[str, float] = {}
        self.reads_posted: dict[str, int] = {}  # READs posted per request (bench: how well layers coalesced)

    def mergeable(self, read: Read, other: Read) -> bool:
        """`other` can join `read`'s READ: the next layer of a source not yet prepared."""
        source = self.sources.get((read.request_id, read.sender_id))
        return read.extends(other) and source is not None and source.handles is None

    def prepare(self, key: SourceKey, peer: PeerPool) -> None:
        """Make the prepared READ of every layer of a page-to-page source not posted yet, back
        to back (raises on a NIXL error, with nothing left prepared). Once per source."""
        source = self.sources.get(key)
        if source is None or not source.homogeneous or source.handles is not None:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        todo = np.flatnonzero(~source.posted)
        handles: list = [None] * source.num_layers
        if len(todo):
            local = self.nixl.index_rows(self.nixl.pool.num_pages, source.dst_pages, slot=0)
            remote = self.nixl.index_rows(peer.num_pages, source.src_pages, slot=1)
            try:
                for layer in todo:
                    handles[layer] = self.nixl.agent.make_prepped_xfer("READ", self.nixl.local_pages, local[layer],
                                                                       peer.dlist, remote[layer])
            except Exception:
                self.release(handles)
                raise
        source.handles = handles
        self.count_setup(key[0], time.thread_time() - c0, time.perf_counter() - t0)

    def take(self, read: Read, peer: PeerPool) -> object:
        """The READ handle for a page-to-page read: its layer's prepared READ, or one made now
        for the read's layers (released prepared READs of those layers, if any)."""
        source = self.sources[(read.request_id, read.sender_id)]
        span = slice(read.layer, read.layer + read.layers)
        if source.posted[span].any():
            raise RuntimeError(f"layers {span.start}..{span.stop - 1} are read already")
        source.posted[span] = True
        handles = source.handles
        if handles is not None and read.layers == 1 and handles[read.layer] is not None:
            handle, handles[read.layer] = handles[read.layer], None
            return handle
        t0, c0 = time.perf_counter(), time.thread_time()
        local = self.nixl.index_rows(self.nixl.pool.num_pages, source.dst_pages, 0, read.layer, read.layers)
        remote = self.nixl.index_rows(peer.num_pages, source.src_pages, 1, read.layer, read.layers)
        handle = self.nixl.agent.make_prepped_xfer("READ", self.nixl.local_pages, local.reshape(-1),
                                                   peer.dlist, remote.reshape(-1))
        if handles is not None:
            self.release(handles[span])
            handles[span] = [None] * read.layers
        self.count_setup(read.request_id, time.thread_time() - c0, time.perf_counter() - t0)
        return handle

    def count_setup(self, request_id: str, cpu_s: float, wall_s: float) -> None:
        if len(self.setup_s) > 4096:
            self.setup_s.clear()
            self.setup_wall_s.clear()
            self.reads_posted.clear()
        self.setup_s[request_id] = self.setup_s.get(request_id, 0.0) + cpu_s
        self.setup_wall_s[request_id] = self.setup_wall_s.get(request_id, 0.0) + wall_s

    def count_post(self, request_id: str) -> None:
        self.reads_posted[request_id] = self.reads_posted.get(request_id, 0) + 1

    def release(self, handles) -> None:
        for handle in handles:
            if handle is not None:
                try:
                    self.nixl.agent.release_xfer_handle(handle)
                except Exception:
                    pass

    def forget(self, key: SourceKey) -> None:
        source = self.sources.pop(key, None)
        if source is not None and source.handles:
            self.release(source.handles)  # layers never read: their READs were never posted

    def keys_of(self, request_id: str) -> list[SourceKey]:
        return [key for key in list(self.sources) if key[0] == request_id]
