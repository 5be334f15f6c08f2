"""Protobuf wire framing by hand, for messages no encoder would send (the split tests)."""

from __future__ import annotations


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    """Field ``number`` of wire type 2 (bytes, string, message, packed)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def varint_field(number: int, value: int) -> bytes:
    """Field ``number`` of wire type 0."""
    return varint(number << 3) + varint(value)
