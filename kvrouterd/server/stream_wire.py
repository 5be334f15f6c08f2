"""A RouteStream batch read from its wire bytes, item by item, instead of parsed by upb.

Parsed by upb, a batch then had each item's fields read back through upb (``ListFields`` for
every Route and Complete, attribute and oneof lookups for every item) and each prompt copied
into a new ``bytes``. The native reader (``index/_native.c``: ``stream_batch_items``) reads a
batch of the plain form encoders write straight into the tuples ``route_request_packed`` and
``completion_of`` take in place of a message (``WireRoute``, ``WireComplete``), the prompt a
view of the received bytes: the daemon's code per streamed Route + Complete is 126k
instructions where it was 145k (``benchmarks.instructions``), its batch handler's time in the
live server ~15% less. Everything else (another encoding, a message that is not a batch, a
batch the handler refuses whole, no extension) is parsed by upb as before, and an item a native
pass declines is parsed by upb from its own bytes (``convert.route_request``,
``convert.completion``), so every answer is the one the message would have had.
"""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf.message import Message

from .._generated.kvrouter.v1 import router_pb2 as pb
from ..index import native

__all__ = ["WireBatch", "WireComplete", "WireItem", "WireRoute", "as_message", "stream_message"]

#: A Route's fields as ``route_request_packed`` reads them (``RR_FIELDS``' order), then where the
#: RouteRequest's own bytes are (``as_message``: ``convert.route_request`` parses them when the
#: pass declines); that alone for a prompt sent as token_ids or block_keys (the reference's forms)
WireRoute = tuple[Any, ...]
#: A Complete's ten fields in declaration order, then where the CompleteRequest's own bytes are
WireComplete = tuple[Any, ...]
#: (item id, "route" or "complete", its fields)
WireItem = tuple[int, str, Any]

_M = TypeVar("_M", bound=Message)

_read_items = native.module.stream_batch_items if native.module is not None else None


class WireBatch:
    """A RouteStreamRequest that is a batch, as ``stream_message`` read it: ``items`` in order;
    ``message()`` parses the whole message with upb (admission queues take messages)."""

    __slots__ = ("data", "items")

    def __init__(self, data: bytes, items: list[WireItem]) -> None:
        self.data = data
        self.items = items

    def message(self) -> pb.RouteStreamRequest:
        return pb.RouteStreamRequest.FromString(self.data)


def as_message(msg: _M | WireRoute | WireComplete, message: type[_M]) -> _M:
    """``msg`` as a ``message``: itself, or (a batch's Route or Complete as read into its
    fields) upb's parse of its own bytes, which the fields end with (its batch's bytes, its
    start and end in them): what the references of the native passes read."""
    if not isinstance(msg, tuple):
        return msg
    data, start, end = msg[-3:]
    return message.FromString(memoryview(data)[start:end])


def stream_message(data: bytes, max_items: int) -> pb.RouteStreamRequest | WireBatch:
    """A RouteStream message of ``data``: its batch read natively (a batch of 1 to ``max_items``
    items in the plain form), else the message as upb parses it, which raises DecodeError for
    bytes that do not parse."""
    if _read_items is not None:
        items = _read_items(data, max_items)
        if items is not None:
            return WireBatch(data, items)
    return pb.RouteStreamRequest.FromString(data)
