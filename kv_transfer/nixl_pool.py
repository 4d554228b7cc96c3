"""A worker's NIXL agent and its registered KV pool, set up once at start-up.

The pool's layer tensors (and, on receivers, one staging buffer) are registered once.
Descriptor lists are built once with numpy, one descriptor per (layer, page), and
prepared once per peer; a request then transfers with index arrays into those prepared
lists (`layer * num_pages + page`), so per-request set-up is two vectorized ops and one
prepared transfer per layer (nixl_receiver.py makes them in one pass).
"""
from __future__ import annotations

import logging
import os
import threading

import numpy as np
import torch

from kv_transfer.layout import KVLayout, KVPool
from proto.pdcluster.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

_PROBE = pb.NixlNotice()  # no kind set: a liveness probe, dropped by notifications()

# UCX settings applied (unless the environment already sets them) before the first agent starts;
# UCX reads only its environment. They matter where UCX moves KV over its TCP transport (across
# hosts without RDMA); on one host UCX picks CMA / shared memory and ignores them. UCX's TCP
# transport has no RDMA READ: a READ is emulated by active messages, the sender's worker answering
# with the data in fragments of UCX_TCP_TX_SEG_SIZE (UCX's default 8 KiB: 64k fragments, each a
# copy, a send() and a receive handler, for a 512 MiB KV). With 512 KiB fragments and the faster
# polls of TransferConfig (nixl_sender_poll_s, poll_backoff_max_s) a 512 MiB KV crosses two
# network-namespaced hosts at ~0.9 of a raw TCP socket between them instead of ~0.5 (either change
# alone: ~0.5-0.7; docs/benchmarks.md, "Across hosts"); RX_SEG_SIZE must hold a whole TX segment.
UCX_ENV_DEFAULTS: dict[str, str] = {
    "UCX_TCP_TX_SEG_SIZE": "512k",
    "UCX_TCP_RX_SEG_SIZE": "512k",
}


def apply_ucx_defaults(net_devices: str = "") -> None:
    """Set UCX_NET_DEVICES (when given) and UCX_ENV_DEFAULTS where the environment leaves them unset."""
    if net_devices:
        os.environ.setdefault("UCX_NET_DEVICES", net_devices)
    for key, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def nixl_api():
    """Import NIXL lazily so the package imports without it."""
    from nixl import _api  # noqa: PLC0415
    return _api


def page_descs(bases: np.ndarray, page_bytes: int, num_pages: int, device_id: int) -> np.ndarray:
    """Nx3 (addr, len, dev) rows, row `layer * num_pages + page`."""
    addr = bases.astype(np.uint64)[:, None] + np.arange(num_pages, dtype=np.uint64)[None, :] * np.uint64(page_bytes)
    rows = np.empty((addr.size, 3), dtype=np.uint64)
    rows[:, 0] = addr.reshape(-1)
    rows[:, 1] = page_bytes
    rows[:, 2] = device_id
    return rows


class PeerPool:
    """A remote sender's pool as this agent sees it: a prepared list of its pages."""

    def __init__(self, agent_name: str, layout: KVLayout, num_pages: int, dlist) -> None:
        self.agent_name, self.layout, self.num_pages, self.dlist = agent_name, layout, num_pages, dlist

    def indices(self, layer: int, pages: np.ndarray) -> np.ndarray:
        return (layer * self.num_pages + pages).astype(np.int32)


class NixlPoolAgent:
    def __init__(self, name: str, pool: KVPool, staging_bytes: int = 0, ucx_net_devices: str = "lo") -> None:
        apply_ucx_defaults(ucx_net_devices)
        api = nixl_api()
        # no NIXL progress thread: our own poll loop drives progress (check_xfer_state /
        # get_new_notifs), which keeps idle agents from spinning a core each
        conf = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                     sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.api, self.name, self.pool = api, name, pool
        self.agent = api.nixl_agent(name, conf)
        first = pool.layers[0]
        self.mem_type = "DRAM" if first.device.type == "cpu" else "VRAM"
        self.device_id = max(first.get_device(), 0)
        self._regs = [self.agent.register_memory(pool.layers)]
        self.bases = np.array([t.data_ptr() for t in pool.layers], dtype=np.uint64)
        self.local_pages = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", page_descs(self.bases, pool.layout.page_bytes, pool.num_pages, self.device_id),
            self.mem_type)
        self.staging = torch.zeros(staging_bytes, dtype=torch.uint8, device=first.device) if staging_bytes else None
        if self.staging is not None:
            self._regs.append(self.agent.register_memory(self.staging))
        self._staging_lists: dict[int, object] = {}
        self._scratch: dict[int, np.ndarray] = {}
        self._offsets: dict[tuple[int, int], np.ndarray] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Release prepared lists and registrations so the agent (and its UCX worker) goes away."""
        handles = [self.local_pages, *self._staging_lists.values()]
        self._staging_lists.clear()
        for handle in handles:
            try:
                self.agent.release_dlist_handle(handle)
            except Exception:
                pass
        for reg in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                pass
        self._regs.clear()
        self.agent = None

    def index_rows(self, num_pages: int, pages: np.ndarray, slot: int = 0, first: int = 0,
                   count: int | None = None) -> np.ndarray:
        """int32 [count, len(pages)]: row i indexes `pages` of layer `first + i` (default: every
        layer) in a list built by page_descs (local or a peer's, whose pool has `num_pages`
        pages). The result lives in scratch buffer `slot`, valid until the next call with that
        slot: NIXL copies indices when it makes a transfer, and fresh arrays cost page faults
        on every request."""
        layers, n = self.pool.layout.num_layers, len(pages)
        count = layers - first if count is None else count
        scratch = self._scratch.get(slot)
        if scratch is None or scratch.shape[1] < n:
            scratch = self._scratch[slot] = np.empty((layers, max(n, 64)), dtype=np.int32)
        key = (slot, num_pages)
        if key not in self._offsets:
            self._offsets[key] = np.arange(0, layers * num_pages, num_pages, dtype=np.int32)[:, None]
        out = scratch[:count, :n]
        np.add(self._offsets[key][first:first + count], np.asarray(pages, dtype=np.int32)[None, :], out=out)
        return out

    def pool_info(self) -> pb.NixlPoolInfo:
        return pb.NixlPoolInfo(agent_name=self.name, agent_metadata=self.agent.get_agent_metadata(),
                               layer_base_addr=self.bases.tolist(), page_bytes=self.pool.layout.page_bytes,
                               num_pages=self.pool.num_pages, device_id=self.device_id, mem_type=self.mem_type)

    def conn_metadata(self) -> bytes:
        """Connection info only: peers can notify this agent but see none of its memory."""
        empty = self.api.nixlBind.nixlRegDList(self.api.nixlBind.DRAM_SEG)
        return self.agent.get_partial_agent_metadata(empty, True)

    def add_peer_pool(self, info: pb.NixlPoolInfo, layout: KVLayout) -> PeerPool:
        if info.page_bytes != layout.page_bytes or len(info.layer_base_addr) != layout.num_layers:
            raise ValueError("nixl pool info disagrees with the sender's layout (page_bytes or layer count)")
        name = self.add_remote(info.agent_metadata)
        bases = np.asarray(info.layer_base_addr, dtype=np.uint64)
        dlist = self.agent.prep_xfer_dlist(name, page_descs(bases, info.page_bytes, info.num_pages, info.device_id),
                                           info.mem_type or "DRAM")
        return PeerPool(name, layout, info.num_pages, dlist)

    def add_remote(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def staging_slots(self, page_bytes: int) -> tuple[int, object]:
        """How many peer pages of `page_bytes` fit in the staging buffer, and their prepared list."""
        slots = 0 if self.staging is None else self.staging.numel() // page_bytes
        if slots == 0:
            return 0, None
        with self._lock:
            if page_bytes not in self._staging_lists:
                rows = page_descs(np.array([self.staging.data_ptr()], dtype=np.uint64), page_bytes, slots,
                                  self.device_id)
                self._staging_lists[page_bytes] = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self.mem_type)
            return slots, self._staging_lists[page_bytes]

    def notify(self, agent_name: str, message: pb.NixlNotice) -> bool:
        try:
            self.agent.send_notif(agent_name, message.SerializeToString())
            return True
        except Exception as exc:  # a dead peer: the caller fails the request
            log.warning("nixl notification to %s failed: %s", agent_name, exc)
            return False

    def probe(self, agent_name: str) -> bool:
        """Whether the peer's agent still answers: an empty notice (peers ignore it) fails at
        once with NIXL_ERR_REMOTE_DISCONNECT once the peer process is gone (~30 ms after a
        SIGKILL here), which a transfer deadline would take seconds to notice."""
        return self.notify(agent_name, _PROBE)

    def notifications(self) -> list[tuple[str, pb.NixlNotice]]:
        out = []
        for peer, messages in self.agent.get_new_notifs().items():
            peer = peer.decode() if isinstance(peer, bytes) else peer
            for raw in messages:
                msg = pb.NixlNotice()
                try:
                    msg.ParseFromString(raw)
                except Exception:
                    log.warning("nixl: undecodable notification from %s dropped", peer)
                    continue
                if msg.WhichOneof("kind") is not None:  # empty: a peer's liveness probe
                    out.append((peer, msg))
        return out
