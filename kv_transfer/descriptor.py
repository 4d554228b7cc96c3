"""The destination descriptor: what a receiver publishes for one request (endpoint,
transport, its page ids, token count, layout, compatibility info). Serializable as
protobuf so the router can carry it from the decode worker to the prefill worker."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kv_transfer.handshake import CompatInfo
from kv_transfer.layout import KVLayout
from proto.pdcluster.v1 import kv_transfer_pb2 as pb


@dataclass(slots=True, frozen=True)
class DestinationDescriptor:
    request_id: str
    transport: str
    endpoint: str
    page_ids: tuple[int, ...]
    num_tokens: int
    layout: KVLayout
    compat: CompatInfo

    def page_array(self) -> np.ndarray:
        return np.asarray(self.page_ids, dtype=np.int64)

    def to_proto(self) -> pb.DestinationDescriptor:
        return pb.DestinationDescriptor(request_id=self.request_id, transport=self.transport, endpoint=self.endpoint,
                                        page_ids=list(self.page_ids), num_tokens=self.num_tokens,
                                        layout=self.layout.to_proto(), compat=self.compat.to_proto())

    def to_bytes(self) -> bytes:
        return self.to_proto().SerializeToString()

    @classmethod
    def from_proto(cls, msg: pb.DestinationDescriptor) -> DestinationDescriptor:
        return cls(msg.request_id, msg.transport, msg.endpoint, tuple(msg.page_ids), msg.num_tokens,
                   KVLayout.from_proto(msg.layout), CompatInfo.from_proto(msg.compat))

    @classmethod
    def from_bytes(cls, data: bytes) -> DestinationDescriptor:
        msg = pb.DestinationDescriptor()
        msg.ParseFromString(data)
        return cls.from_proto(msg)
