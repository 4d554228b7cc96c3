"""Versioned handshake: every peer connection starts with the sender's compatibility
info (model id, layers, kv heads, head dim, dtype, page layout, protocol version, and
their hash) and layout, which carries the sender rank's tensor-parallel topology (TP size
and rank); the receiver answers accept or refuse with the failing field named, and its own
layout (its topology too). Nothing else is accepted from a sender that has not handshaken
successfully.

Besides model compatibility, the receiver refuses a pairing whose heads cannot line up:
either side's layout not the head range its TP rank holds of the model's kv heads
(engine/parallel.py TPShard, layout.tp_head_range), or no head in common. A refusal past
the protocol checks names both sides (`sender tp 2 rank 1 heads [2, 4) page 16 float32 ... /
receiver tp 4 rank 0 heads [0, 1) ...: why`); the sender fails its transfer with it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kv_transfer.layout import PAGE_LAYOUT, KVLayout, ModelSpec
from proto.pdcluster.v1 import kv_transfer_pb2 as pb

PROTOCOL_VERSION = 1


class HandshakeError(RuntimeError):
    """The peers are incompatible or the handshake could not complete."""


@dataclass(slots=True, frozen=True)
class CompatInfo:
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_layout: str = PAGE_LAYOUT
    protocol_version: int = PROTOCOL_VERSION

    @classmethod
    def of(cls, spec: ModelSpec, layout: KVLayout) -> CompatInfo:
        return cls(spec.model_id, spec.num_layers, spec.num_kv_heads, spec.head_dim, layout.dtype)

    @property
    def hash(self) -> str:
        text = "|".join(str(v) for v in (self.model_id, self.num_layers, self.num_kv_heads, self.head_dim,
                                          self.dtype, self.page_layout, self.protocol_version))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_proto(self) -> pb.CompatInfo:
        return pb.CompatInfo(model_id=self.model_id, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim, dtype=self.dtype, page_layout=self.page_layout,
                             protocol_version=self.protocol_version, hash=self.hash)

    @classmethod
    def from_proto(cls, msg: pb.CompatInfo) -> CompatInfo:
        return cls(msg.model_id, msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.dtype, msg.page_layout,
                   msg.protocol_version)


def check_compat(local: CompatInfo, remote_msg: pb.CompatInfo,
                 allowed_dtype_conversions: frozenset[tuple[str, str]]) -> str | None:
    """Receiver-side check; returns the refusal reason or None. `local` is the receiver's."""
    remote = CompatInfo.from_proto(remote_msg)
    if remote.hash != remote_msg.hash:
        return "compat.hash does not match its own fields (corrupt or forged handshake)"
    if remote.hash == local.hash:
        return None
    for name in ("protocol_version", "model_id", "num_layers", "num_kv_heads", "head_dim", "page_layout"):
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            return f"compat.{name} mismatch: sender {theirs!r}, receiver {mine!r}"
    if (remote.dtype, local.dtype) not in allowed_dtype_conversions:
        return (f"compat.dtype mismatch: sender {remote.dtype!r}, receiver {local.dtype!r} "
                f"and that conversion is not allowed")
    return None


def check_layouts(sender: KVLayout, receiver: KVLayout, num_kv_heads: int | None = None) -> str | None:
    """Layouts the transfer can map between (page sizes and TP sizes may differ; heads must
    overlap). With `num_kv_heads` (the model's, agreed in the compat check) each side's head
    range must also be the one its TP rank holds."""
    for name in ("num_layers", "head_dim"):
        if getattr(sender, name) != getattr(receiver, name):
            return (f"layout.{name} differs: sender {getattr(sender, name)}, receiver "
                    f"{getattr(receiver, name)}")
    if num_kv_heads is not None:
        for side, lay in (("sender", sender), ("receiver", receiver)):
            why = lay.topology_error(num_kv_heads)
            if why is not None:
                return f"{side} layout inconsistent with its tensor-parallel topology: {why}"
    if max(sender.head_start, receiver.head_start) >= min(sender.head_end, receiver.head_end):
        return (f"layout heads do not overlap: sender [{sender.head_start}, {sender.head_end}), "
                f"receiver [{receiver.head_start}, {receiver.head_end})")
    return None


def describe_pair(sender: KVLayout | str, receiver: KVLayout) -> str:
    """`sender <layout> / receiver <layout>` for refusal messages."""
    s = sender.describe() if isinstance(sender, KVLayout) else sender
    return f"sender {s} / receiver {receiver.describe()}"


def make_request(spec: ModelSpec, layout: KVLayout, transport: str, sender_id: str,
                 nixl: pb.NixlPoolInfo | None = None) -> pb.HandshakeRequest:
    msg = pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, compat=CompatInfo.of(spec, layout).to_proto(),
                              layout=layout.to_proto(), transport=transport, sender_id=sender_id)
    if nixl is not None:
        msg.nixl.CopyFrom(nixl)
    return msg


def answer(request: pb.HandshakeRequest, spec: ModelSpec, layout: KVLayout, transport: str, receiver_id: str,
           allowed_dtype_conversions: frozenset[tuple[str, str]]) -> pb.HandshakeReply:
    """The receiver's verdict on a handshake, before any transport-specific set-up."""
    reason = None
    if request.protocol_version != PROTOCOL_VERSION:
        reason = f"protocol_version {request.protocol_version} unsupported (receiver speaks {PROTOCOL_VERSION})"
    elif request.transport != transport:
        reason = f"transport {request.transport!r} sent to a {transport!r} receiver"
    else:
        try:
            sender: KVLayout | str = KVLayout.from_proto(request.layout)
        except ValueError as exc:
            sender, reason = "(invalid layout)", f"sender layout invalid: {exc}"
        else:
            reason = check_compat(CompatInfo.of(spec, layout), request.compat, allowed_dtype_conversions)
            if reason is None and (sender.num_layers, sender.head_dim, sender.dtype) != (
                    request.compat.num_layers, request.compat.head_dim, request.compat.dtype):
                reason = "sender layout disagrees with its own compat info on num_layers, head_dim or dtype"
            if reason is None:
                reason = check_layouts(sender, layout, spec.num_kv_heads)
        if reason is not None:
            reason = f"{describe_pair(sender, layout)}: {reason}"
    return pb.HandshakeReply(accepted=reason is None, reason=reason or "", layout=layout.to_proto(),
                             receiver_id=receiver_id)
