"""Requests as bytes, before they are messages: a request the protobuf runtime cannot parse
gets INVALID_ARGUMENT naming the field, never gRPC's UNKNOWN.

`safe_deserializer(cls)` is what the server decodes requests with: a parsed message, or a
`BadRequest` saying which field broke. The protobuf runtime refuses a string field that is not
UTF-8 without naming it, so `bad_utf8_field` walks the wire format with the message's
descriptor to find it ("messages[1].content", "sampling.stop[0]").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message


@dataclass(frozen=True, slots=True)
class BadRequest:
    """What a request that could not be decoded becomes; the handler answers INVALID_ARGUMENT."""

    reason: str


def safe_deserializer(cls: type[Message]) -> Callable[[bytes], Message | BadRequest]:
    def deserialize(data: bytes) -> Message | BadRequest:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            path = bad_utf8_field(cls.DESCRIPTOR, data)
            if path is not None:
                return BadRequest(f"{path} must be valid UTF-8 text")
            return BadRequest(f"the request is not a valid {cls.DESCRIPTOR.full_name}: {exc}")
    return deserialize


def bad_utf8_field(desc: Descriptor, data: bytes | memoryview, prefix: str = "") -> str | None:
    """The path of the first string field in `data` (wire format of `desc`) that is not UTF-8,
    or None (also for data too broken to walk)."""
    counts: dict[str, int] = {}
    pos, end = 0, len(data)
    try:
        while pos < end:
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + size], pos + size
                field = desc.fields_by_number.get(number)
                if field is None:
                    continue
                name = field.name
                if field.is_repeated:
                    index = counts.get(name, 0)
                    counts[name] = index + 1
                    name = f"{name}[{index}]"
                path = prefix + name
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        bytes(chunk).decode("utf-8")
                    except UnicodeDecodeError:
                        return path
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = bad_utf8_field(field.message_type, chunk, path + ".")
                    if found is not None:
                        return found
            else:
                return None
    except IndexError:
        return None
    return None


def _varint(data, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
