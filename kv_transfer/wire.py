"""The gRPC transport's Push items on the wire, without copying page bytes through protobuf.

A chunk is `PushItem(chunk=PageChunk(..., data=payload))` in plain protobuf encoding, so any
protobuf reader can read it. Both ends handle the payload themselves because copies of
megabyte buffers are what this stream's speed is made of: the sender writes the data field
first, then the small header encoded by protobuf (one copy of the payload; fields may come in
any order); the receiver reads the data field's tag and length, hands the rest to protobuf
and keeps the payload as a view into the message gRPC delivered (`decode_push`; items in
any other field order take the general path, a walk over the fields). Parsing it with
protobuf instead copied the payload twice more (parse, then each `.data` read), and each
fresh megabyte buffer costs its page faults: the receiver spent more time there than on the
copy into pages.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from proto.pdcluster.v1 import kv_transfer_pb2 as pb

_CHUNK = 1      # PushItem.chunk
_FINAL = 2      # PushItem.final
_DATA = 7       # PageChunk.data
_LEN = 2        # wire type: length-delimited


class WireError(ValueError):
    """A Push item that is not valid protobuf for PushItem."""


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


_CHUNK_TAG = varint(_CHUNK << 3 | _LEN)
_DATA_TAG = varint(_DATA << 3 | _LEN)


def encode_chunk(header: pb.PageChunk, payload: memoryview) -> bytes:
    """The wire bytes of `PushItem(chunk=header with data=payload)`; `header.data` must be empty.
    The data field comes first, so the receiver finds the payload without walking the header."""
    head = header.SerializeToString()
    data = _DATA_TAG + varint(payload.nbytes)
    return b"".join((_CHUNK_TAG, varint(len(data) + payload.nbytes + len(head)), data, payload, head))


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)


def encode_chunk_into(header: pb.PageChunk, nbytes: int, fill: Callable[[memoryview], None]) -> bytes:
    """`encode_chunk`, with the payload written by `fill` straight into the new message (a
    gather of pages, say) instead of copied in: gRPC Python sends only `bytes`, so this makes
    an uninitialized bytes object, as C code does, and fills it before anyone else sees it."""
    head = header.SerializeToString()
    data = _DATA_TAG + varint(nbytes)
    prefix = _CHUNK_TAG + varint(len(data) + nbytes + len(head)) + data
    start, end = len(prefix), len(prefix) + nbytes
    message = _new_bytes(None, end + len(head))
    view = memoryview((ctypes.c_char * (end + len(head))).from_address(
        ctypes.cast(message, ctypes.c_void_p).value)).cast("B")
    view[:start] = prefix
    fill(view[start:end])
    view[end:] = head
    return message


def encode_final(final: pb.FinalNotice) -> bytes:
    return pb.PushItem(final=final).SerializeToString()


@dataclass(slots=True)
class PushFrame:
    """One decoded Push item: a chunk header and its payload (a view, not a copy), or a final notice."""

    chunk: pb.PageChunk | None = None
    payload: memoryview | None = None
    final: pb.FinalNotice | None = None


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int):
    """(field number, wire type, field start, value start, value end) of each field in buf[pos:end]."""
    while pos < end:
        first = pos
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        start = pos
        if wire_type == 0:
            _, pos = _read_varint(buf, pos, end)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == _LEN:
            n, start = _read_varint(buf, pos, end)
            pos = start + n
        else:
            raise WireError(f"unsupported wire type {wire_type} (field {field})")
        if pos > end or field == 0:
            raise WireError("field runs past the end of its message")
        yield field, wire_type, first, start, pos


def _decode_data_first(buf: memoryview) -> PushFrame | None:
    """The fast path for what encode_chunk writes: one chunk whose data field comes first, so
    the rest of it is the header, parsed by protobuf in one call. None: take the general path."""
    n = len(buf)
    if n < 3 or buf[0] != _CHUNK_TAG[0]:
        return None
    length, pos = _read_varint(buf, 1, n)
    if pos + length != n or pos >= n or buf[pos] != _DATA_TAG[0]:
        return None
    size, start = _read_varint(buf, pos + 1, n)
    end = start + size
    if end > n:
        return None
    try:
        header = pb.PageChunk.FromString(buf[end:n])
    except DecodeError:
        return None  # the general path names what is wrong
    payload = buf[start:end]
    if header.data:  # a second data field after the first: the last one wins, as in protobuf
        payload, header.data = memoryview(header.data), b""
    return PushFrame(chunk=header, payload=payload)


def decode_push(raw: bytes) -> PushFrame:
    """The gRPC request deserializer of Push: a PushItem, its chunk's payload left in place."""
    buf = memoryview(raw)
    fast = _decode_data_first(buf)
    if fast is not None:
        return fast
    frame = PushFrame()
    for field, wire_type, _, start, end in _fields(buf, 0, len(buf)):
        if wire_type != _LEN or field not in (_CHUNK, _FINAL):
            continue  # unknown fields are skipped, as protobuf does
        frame.chunk = frame.payload = frame.final = None  # a oneof: the last one wins
        if field == _FINAL:
            frame.final = pb.FinalNotice.FromString(buf[start:end])
            continue
        header, payload = [], None
        for inner, inner_type, first, a, b in _fields(buf, start, end):
            if inner == _DATA and inner_type == _LEN:
                payload = buf[a:b]  # the last one wins, as in protobuf
            else:
                header.append(buf[first:b])
        frame.chunk = pb.PageChunk.FromString(b"".join(header))
        frame.payload = payload if payload is not None else memoryview(b"")
    if frame.chunk is None and frame.final is None:
        raise WireError("Push item carries neither a chunk nor a final notice")
    return frame

