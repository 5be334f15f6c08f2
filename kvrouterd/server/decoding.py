"""Undecodable request messages answer INVALID_ARGUMENT, for every method of every service.

grpc.aio calls a method's request deserializer before (unary) or while (streams) the handler
runs, and turns anything it raises into ``UNKNOWN: Unexpected <class DecodeError>``: the
caller cannot tell its own malformed bytes from a daemon bug. ``SafeRegistrar`` stands in for
the server while services register (the generated ``add_*Servicer_to_server`` functions,
health, reflection, ext_proc) and wraps each method handler:

* a unary request that does not parse reaches the handler as an ``Undecodable`` marker, and
  the wrapper aborts with INVALID_ARGUMENT before the servicer sees anything;
* a streamed message that does not parse raises ``UndecodableMessage`` out of the handler's
  ``async for``, and the wrapper turns it into INVALID_ARGUMENT. Messages of the stream read
  before it stay applied, as with any other rejected stream message.

Handlers are wrapped once at registration, not per call by an interceptor: the data path pays
one type check (unary) or nothing (streams) per message.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from ..errors import quote
from .status import status_message

__all__ = ["SafeRegistrar", "Undecodable", "UndecodableMessage", "describe"]

_INVALID = grpc.StatusCode.INVALID_ARGUMENT


class UndecodableMessage(Exception):
    """A streamed request message that is not a valid protobuf of the method's type."""


class Undecodable:
    """What a unary handler receives instead of a request that does not parse."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def describe(type_name: str, exc: Exception, size: int) -> str:
    """Why a request message does not parse, as its caller is told (also for a RouteStream message
    found malformed off the loop: ``KVRouterService``)."""
    return f"request is not a valid {type_name} message ({size} bytes): {quote(str(exc), 200)}"


def _safe_unary_deserializer(deserializer: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, ValueError, TypeError) as exc:  # upb raises DecodeError; others ValueError
            return Undecodable(describe(type_name, exc, len(data)))

    return deserialize


def _safe_stream_deserializer(deserializer: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, ValueError, TypeError) as exc:
            raise UndecodableMessage(describe(type_name, exc, len(data))) from None

    return deserialize


def _type_name(deserializer: Callable[[bytes], Any] | None) -> str:
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", None) or "request"


def wrap_handler(
    handler: grpc.RpcMethodHandler, deserializer: Callable[[bytes], Any] | None = None
) -> grpc.RpcMethodHandler:
    """The same handler, answering INVALID_ARGUMENT for request messages that do not parse.
    ``deserializer`` replaces the handler's own (Route's splits huge prompts: ``off_loop.route_message``)."""
    name = _type_name(handler.request_deserializer)
    deserializer = deserializer or handler.request_deserializer
    if deserializer is None:
        return handler
    serializer = handler.response_serializer
    if not handler.request_streaming:
        safe = _safe_unary_deserializer(deserializer, name)
        if handler.response_streaming:
            wrapped = grpc.unary_stream_rpc_method_handler(_unary_stream(handler.unary_stream), safe, serializer)
        else:
            wrapped = grpc.unary_unary_rpc_method_handler(_unary_unary(handler.unary_unary), safe, serializer)
    else:
        safe = _safe_stream_deserializer(deserializer, name)
        if handler.response_streaming:
            wrapped = grpc.stream_stream_rpc_method_handler(_stream_stream(handler.stream_stream), safe, serializer)
        else:
            wrapped = grpc.stream_unary_rpc_method_handler(_stream_unary(handler.stream_unary), safe, serializer)
    return wrapped


def _unary_unary(inner: Callable[..., Any]) -> Callable[..., Any]:
    async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is Undecodable:
            await context.abort(_INVALID, request.message)
        return await inner(request, context)

    return behavior


def _unary_stream(inner: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(inner):
        async def generate(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if type(request) is Undecodable:
                await context.abort(_INVALID, request.message)
            async for reply in inner(request, context):
                yield reply

        return generate

    async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:  # writes with context.write
        if type(request) is Undecodable:
            await context.abort(_INVALID, request.message)
        return await inner(request, context)

    return behavior


def _stream_unary(inner: Callable[..., Any]) -> Callable[..., Any]:
    async def behavior(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        try:
            return await inner(requests, context)
        except UndecodableMessage as exc:
            await context.abort(_INVALID, status_message(exc))

    return behavior


def _stream_stream(inner: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(inner):
        async def generate(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for reply in inner(requests, context):
                    yield reply
            except UndecodableMessage as exc:
                await context.abort(_INVALID, status_message(exc))

        return generate
    return _stream_unary(inner)  # a handler that writes with context.write: awaited like stream-unary


class _SafeGenericHandler(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, deserializers: Mapping[str, Callable[[bytes], Any]]) -> None:
        self._inner = inner
        self._deserializers = deserializers
        self._wrapped: dict[str, grpc.RpcMethodHandler | None] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method not in self._wrapped:
            handler = self._inner.service(handler_call_details)
            self._wrapped[method] = (wrap_handler(handler, self._deserializers.get(method))
                                     if handler is not None else None)
        return self._wrapped[method]


class SafeRegistrar:
    """Pass as the ``server`` to ``add_*_to_server`` functions: registers on ``server`` with
    every method handler wrapped (see the module docstring). ``deserializers`` maps a method's
    full name (``/package.Service/Method``) to a deserializer used instead of its generated one."""

    def __init__(self, server: grpc.aio.Server, deserializers: Mapping[str, Callable[[bytes], Any]] | None = None) -> None:
        self._server = server
        self._deserializers = dict(deserializers or {})

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_SafeGenericHandler(h, self._deserializers) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(service, {
            m: wrap_handler(h, self._deserializers.get(f"/{service}/{m}")) for m, h in handlers.items()})
