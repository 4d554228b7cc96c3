"""KV cache transfer between processes: transports (nixl, grpc, local), descriptors, handshake,
page-size/head-range/dtype layout conversion. Must not import Ray, router, or the workers.

Roles: layout.py (pool shapes), mapping.py (token-run conversion), descriptor.py (what a
receiver publishes), handshake.py (compatibility), states.py (ordered states),
receiver_book.py / sender_book.py (page ledgers and validation), service.py (the
receiver's gRPC control service), local.py, grpc_*.py, nixl_*.py (transports), wire.py
(gRPC Push items without payload copies), heap.py (glibc heap settings for megabyte
messages), registry.py (create a transport by name; nixl is imported only when asked for).
"""
from kv_transfer.base import KVReceiver, KVSender
from kv_transfer.config import TransferConfig
from kv_transfer.descriptor import DestinationDescriptor
from kv_transfer.handshake import PROTOCOL_VERSION, CompatInfo, HandshakeError
from kv_transfer.layout import KVLayout, KVPool, ModelSpec
from kv_transfer.receiver_book import TransferRejected
from kv_transfer.registry import create_receiver, create_sender, transport_names
from kv_transfer.states import TransferState, TransferStatus

__all__ = [
    "PROTOCOL_VERSION", "CompatInfo", "DestinationDescriptor", "HandshakeError", "KVLayout", "KVPool", "KVReceiver",
    "KVSender", "ModelSpec", "TransferConfig", "TransferRejected", "TransferState", "TransferStatus",
    "create_receiver", "create_sender", "transport_names",
]
