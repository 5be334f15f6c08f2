"""Protobuf wire framing by hand, for messages no encoder would send (the split tests)."""

from __future__ import annotations

# a varint, and field ``number`` of wire type 2 (bytes, string, message, packed)
from kvrouterd.server.wire import length_delimited as length_delimited
from kvrouterd.server.wire import varint as varint


def varint_field(number: int, value: int) -> bytes:
    """Field ``number`` of wire type 0."""
    return varint(number << 3) + varint(value)


#: fields upb refuses for their framing alone (the split walk stops at each: ``wire._walk``);
#: each is refused wherever it stands, the last field of a message or inside a submessage
CORRUPT_FIELDS = (
    b"\x80",  # a tag cut short
    b"\x80\x80\x80\x80\x80\x01",  # a tag of six bytes
    b"\x88\x80\x80\x80\x10\x00",  # a tag past 32 bits
    b"\x00\x00",  # field 0
    b"\x03",  # field 0 as a group
    bytes([9 << 3 | 4]),  # an end-group tag outside a group
    bytes([9 << 3 | 6, 0]),  # wire types 6 and 7 do not exist
    bytes([9 << 3 | 7, 0]),
    b"\x3a\x05ab",  # a length past the end
    b"\x3a\x80\x80\x80\x80\x80\x00",  # a length of six bytes
    b"\xf8\x01" + b"\xff" * 10 + b"\x01",  # a varint of eleven bytes
    bytes([31 << 3 | 1]) + bytes(7),  # a fixed64 cut short
    bytes([31 << 3 | 5]) + bytes(3),  # a fixed32 cut short
)
