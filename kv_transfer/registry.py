"""Create a transport by name. Modules are imported on first use, so a missing optional
dependency (nixl) only matters to whoever asks for that transport."""
from __future__ import annotations

import importlib

from kv_transfer.base import KVReceiver, KVSender
from kv_transfer.config import TransferConfig
from kv_transfer.layout import KVPool

_TRANSPORTS: dict[str, tuple[str, str, str]] = {
    # name: (module, receiver class, sender class)
    "nixl": ("kv_transfer.nixl_receiver", "NixlReceiver", "kv_transfer.nixl_sender:NixlSender"),
    "grpc": ("kv_transfer.grpc_receiver", "GrpcReceiver", "kv_transfer.grpc_sender:GrpcSender"),
    "local": ("kv_transfer.local", "LocalReceiver", "kv_transfer.local:LocalSender"),
}


def transport_names() -> list[str]:
    return sorted(_TRANSPORTS)


def _entry(name: str) -> tuple[str, str, str]:
    if name not in _TRANSPORTS:
        raise ValueError(f"transport must be one of {transport_names()}, got {name!r}")
    return _TRANSPORTS[name]


def create_receiver(name: str, pool: KVPool, config: TransferConfig | None = None, **kwargs) -> KVReceiver:
    module, cls, _ = _entry(name)
    return getattr(importlib.import_module(module), cls)(pool, config or TransferConfig(), **kwargs)


def create_sender(name: str, pool: KVPool, config: TransferConfig | None = None, **kwargs) -> KVSender:
    module, cls = _entry(name)[2].split(":")
    return getattr(importlib.import_module(module), cls)(pool, config or TransferConfig(), **kwargs)
