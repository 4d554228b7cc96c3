"""Transfer settings shared by all transports (plain dataclass; pydantic lives at the user's edge)."""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_HOST = "127.0.0.1"


@dataclass(slots=True, frozen=True)
class TransferConfig:
    host: str = DEFAULT_HOST                # the receiver's service binds here
    # The cluster's KV-plane credential: when set, every KVTransfer RPC (Handshake, Begin, Push,
    # Cancel) must carry it, or gets UNAUTHENTICATED with nothing done (cluster.runtime makes one
    # per cluster and hands it to its workers). Empty: an open service (tests, library use).
    secret: str = field(default="", repr=False)
    port: int = 0                           # 0 = pick a free port
    deadline_s: float = 30.0                # whole transfer of one request: sender from start(), receiver
                                            # from the first sender's begin
    begin_timeout_s: float = 300.0          # receiver: published pages wait this long for a sender to begin
                                            # (the sender may be queued behind other prefills)
    handshake_timeout_s: float = 5.0        # connect + handshake + begin, per peer
    chunk_bytes: int = 2 << 20              # grpc: payload of one chunk (one gRPC message)
    max_inflight_chunks: int = 4            # grpc: unacknowledged chunks per stream
    grpc_max_message_bytes: int = 64 << 20  # grpc: both directions, set explicitly on channel and server
    grpc_streams: int = 1                   # grpc: parallel Push streams (own TCP connections) per destination
    grpc_tune_malloc: bool = True           # grpc: keep message buffers in the heap (process-wide, heap.py)
    poll_interval_s: float = 0.0005         # progress threads sleep this long when idle
    poll_backoff_max_s: float = 0.001       # nixl: with requests in flight but nothing happening (their
                                            # prefill still running, or one long READ under way), the poll
                                            # period doubles up to this; an event sets it back (bounds the
                                            # delay a notice can wait). Was 4 ms: across hosts UCX's TCP
                                            # transport moves READ data only when both workers progress, so
                                            # 4 ms naps held a 512 MiB KV to ~0.5 of raw TCP (issue 35 item 8,
                                            # docs/benchmarks.md "Across hosts"); 1 ms costs ~1,000 wake-ups a
                                            # second per busy poller instead of ~250
    staging_bytes: int = 64 << 20           # nixl: bounce buffer for heterogeneous layouts
    nixl_coalesce_reads: bool = True        # nixl: consecutive layers ready together before a request's
                                            # first READ lands go as one READ (off: a READ per layer)
    nixl_sender_poll_s: float = 0.0005      # nixl: sender's poll period while requests are in flight. On one
                                            # host it only collects read confirmations (CMA reads need nothing
                                            # of it); across hosts over UCX TCP it also serves the receiver's
                                            # READs (TCP has no RDMA: UCX emulates a READ with messages the
                                            # sender's worker answers when it progresses), so it was 2 ms
                                            # until issue 35 and held cross-host READs to ~0.5 of raw TCP
    liveness_interval_s: float = 0.25       # nixl: probe peers of requests in flight this often (0 = off)
    allowed_dtype_conversions: frozenset[tuple[str, str]] = field(
        default_factory=lambda: frozenset({("float32", "bfloat16"), ("float32", "float16")}))
    server_threads: int = 8                 # nixl: threads of its control service (unary calls only); the
                                            # grpc receiver's service is asyncio and holds no thread per call
    # UCX opens its own listeners; "lo" keeps them on loopback (UCX reads only its environment,
    # so this is applied to UCX_NET_DEVICES before the first agent starts, unless already set;
    # nixl_pool.UCX_ENV_DEFAULTS, e.g. UCX's TCP fragment size, are applied the same way).
    ucx_net_devices: str = "lo"

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.handshake_timeout_s <= 0 or self.begin_timeout_s <= 0:
            raise ValueError("TransferConfig.deadline_s, begin_timeout_s and handshake_timeout_s must be > 0")
        if self.chunk_bytes < 4096 or self.chunk_bytes + (1 << 16) > self.grpc_max_message_bytes:
            raise ValueError("TransferConfig.chunk_bytes must be >= 4096 and leave 64 KiB headroom "
                             "under grpc_max_message_bytes")
        if self.max_inflight_chunks < 1:
            raise ValueError("TransferConfig.max_inflight_chunks must be >= 1")
        if not 0 < self.nixl_sender_poll_s <= 0.1:
            raise ValueError(f"TransferConfig.nixl_sender_poll_s must be in (0, 0.1], got {self.nixl_sender_poll_s}")
        if not 0 < self.poll_backoff_max_s <= 0.1:  # below poll_interval_s it means no back-off
            raise ValueError(f"TransferConfig.poll_backoff_max_s must be in (0, 0.1], got {self.poll_backoff_max_s}")
        if self.liveness_interval_s < 0:
            raise ValueError(f"TransferConfig.liveness_interval_s must be >= 0, got {self.liveness_interval_s}")
        if not 1 <= self.grpc_streams <= 16:
            raise ValueError(f"TransferConfig.grpc_streams must be in [1, 16], got {self.grpc_streams}")
