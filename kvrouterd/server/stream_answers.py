"""A RouteStream batch answer written as wire bytes, item by item, instead of as upb messages.

Built as messages, a batch answer cost each streamed Route + Complete ~1.7 us of the handler's
~25 (an item added to the batch, nine fields of its ``route`` set one by one through upb, the
whole batch serialised at the end). Here each item is its own bytes, framed as an element of
``RouteStreamResponseBatch.items``, and the answer is their concatenation under the
``batch`` field: the same bytes upb writes for the same message (fields in number order,
proto3 defaults left out), which gRPC sends as they are (``passes_bytes``). A Route's item is
made natively (``index/_native.c``, ``route_answer``) where the extension is built and the
result is of the common shape; everything else (no extension, a prefill/decode hop, an error
answer) goes through the upb message, the reference every native answer is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._generated.kvrouter.v1 import router_pb2 as pb
from ..index import native
from ..router import RouteResult
from .convert import route_response
from .wire import length_delimited

__all__ = ["batch_answer", "complete_answer", "message_answer", "passes_bytes", "route_answer"]

#: RouteStreamResponseBatch.items and RouteStreamResponse.batch: the fields an item and the batch go in
_ITEMS_FIELD = 1
_BATCH_FIELD = 5

_route_answer = native.module.route_answer if native.module is not None else None
_complete_answer = native.module.complete_answer if native.module is not None else None


def route_answer(item_id: int, result: RouteResult, block_size: int) -> bytes:
    """The batch item answering Route ``item_id`` with ``result`` (natively where it can: the
    reference is ``_route_answer_py``). Raises what writing the message raises (a count past
    uint32: ValueError), as the message path did, for the caller to answer INTERNAL."""
    if _route_answer is not None:
        answer = _route_answer(item_id, result, block_size)
        if answer is not NotImplemented:
            return answer  # type: ignore[no-any-return]
    return _route_answer_py(item_id, result, block_size)


def _route_answer_py(item_id: int, result: RouteResult, block_size: int) -> bytes:
    """``route_answer``'s reference, of the native ``route_answer``."""
    reply = pb.RouteStreamResponse(id=item_id)
    route_response(result, block_size, into=reply.route)
    return message_answer(reply)


def complete_answer(item_id: int) -> bytes:
    """The batch item answering Complete ``item_id`` (natively: ``_complete_answer_py`` is the reference)."""
    if _complete_answer is not None:
        return _complete_answer(item_id)  # type: ignore[no-any-return]
    return _complete_answer_py(item_id)


def _complete_answer_py(item_id: int) -> bytes:
    """``complete_answer``'s reference, of the native ``complete_answer``."""
    reply = pb.RouteStreamResponse(id=item_id)
    reply.complete.SetInParent()
    return message_answer(reply)


def message_answer(reply: pb.RouteStreamResponse) -> bytes:
    """The batch item of an answer written as a message (an error, or a reference's answer)."""
    return length_delimited(_ITEMS_FIELD, reply.SerializeToString())


def batch_answer(items: list[bytes]) -> bytes:
    """The RouteStreamResponse carrying ``items`` (each from the functions above) as its batch."""
    return length_delimited(_BATCH_FIELD, b"".join(items))


def passes_bytes(serializer: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """RouteStream's response serializer: an answer made as bytes goes as it is, a message is serialised."""

    def serialize(reply: Any) -> bytes:
        return reply if type(reply) is bytes else serializer(reply)

    return serialize
