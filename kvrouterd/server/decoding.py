"""Every method handler of every service, wrapped at registration: each call ends with a precise status.

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

The same wrapper is the one place every call's failure passes (``call_errors.CallErrors``):

* an exception the handler did not expect (a bug) is counted, logged once with its traceback
  and answered INTERNAL with a short message, where grpc would answer a bare UNKNOWN and log
  through its own logger;
* a status the handler chose (``context.abort``: INVALID_ARGUMENT, NOT_FOUND, ...) is counted
  as a rejection of that RPC and code, and logged sampled.

Handlers are wrapped once at registration, not per call by an interceptor: the data path pays
one type check (unary) or nothing (streams) per message, and a try block.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from ..errors import quote
from .call_errors import CallErrors
from .status import status_message

__all__ = ["SafeRegistrar", "Undecodable", "UndecodableMessage", "describe"]

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_INTERNAL = grpc.StatusCode.INTERNAL
#: a status code's number -> its name (``ServicerContext.code()`` may answer either form)
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


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
    handler: grpc.RpcMethodHandler, errors: CallErrors, method: str,
    deserializer: Callable[[bytes], Any] | None = None, serializer: Callable[[Any], bytes] | None = None,
) -> grpc.RpcMethodHandler:
    """The same handler, answering INVALID_ARGUMENT for request messages that do not parse and
    INTERNAL for an unexpected exception, and reporting every failed call of ``method`` (its full
    name, ``/package.Service/Method``) to ``errors``. ``deserializer`` replaces the handler's own
    (Route's splits huge prompts: ``off_loop.route_message``), and ``serializer`` its response
    serializer (RouteStream's sends answers made as bytes as they are: ``stream_answers``)."""
    name = _type_name(handler.request_deserializer)
    deserializer = deserializer or handler.request_deserializer
    calls = _Calls(errors, method.rsplit("/", 1)[-1])
    serializer = serializer or handler.response_serializer
    if not handler.request_streaming:
        safe = _safe_unary_deserializer(deserializer, name) if deserializer is not None else None
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(calls.unary_stream(handler.unary_stream), safe, serializer)
        return grpc.unary_unary_rpc_method_handler(calls.unary_unary(handler.unary_unary), safe, serializer)
    safe = _safe_stream_deserializer(deserializer, name) if deserializer is not None else None
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(calls.stream_stream(handler.stream_stream), safe, serializer)
    return grpc.stream_unary_rpc_method_handler(calls.stream_unary(handler.stream_unary), safe, serializer)


class _Calls:
    """The wrappers of one method's handler (``wrap_handler``), reporting to the ledger as ``rpc``."""

    def __init__(self, errors: CallErrors, rpc: str) -> None:
        self.errors = errors
        self.rpc = rpc
        errors.served(rpc)

    async def _refuse(self, context: grpc.aio.ServicerContext, message: str) -> NoReturn:
        """Bytes that do not parse: INVALID_ARGUMENT (a rejection, reported when it ends the call)."""
        await context.abort(_INVALID, message)
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    def _aborted(self, context: grpc.aio.ServicerContext, request: object = None) -> None:
        """The handler ended the call with a status of its own choosing: a rejection (of
        ``request``, a unary call's message, whose ids the log line names)."""
        code = context.code()
        name = code.name if isinstance(code, grpc.StatusCode) else _CODE_NAMES.get(code, str(code))
        if name not in ("OK", "INTERNAL"):  # INTERNAL was counted where it was raised
            self.errors.rejected(self.rpc, name, context.details() or "", request)

    async def _fail(self, context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
        await context.abort(_INTERNAL, self.errors.internal(self.rpc, exc))
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    def unary_unary(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if type(request) is Undecodable:
                    await self._refuse(context, request.message)
                return await inner(request, context)
            except grpc.aio.AbortError:
                self._aborted(context, request)
                raise
            except Exception as exc:  # noqa: BLE001 - the point: no bug answers UNKNOWN
                await self._fail(context, exc)

        return behavior

    def unary_stream(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(inner):  # writes with context.write: awaited like unary
            return self.unary_unary(inner)

        async def generate(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                if type(request) is Undecodable:
                    await self._refuse(context, request.message)
                async for reply in inner(request, context):
                    yield reply
            except grpc.aio.AbortError:
                self._aborted(context, request)
                raise
            except Exception as exc:  # noqa: BLE001
                await self._fail(context, exc)

        return generate

    def stream_unary(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        async def behavior(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            try:
                try:
                    return await inner(requests, context)
                except UndecodableMessage as exc:
                    await self._refuse(context, status_message(exc))
            except grpc.aio.AbortError:
                self._aborted(context)
                raise
            except Exception as exc:  # noqa: BLE001
                await self._fail(context, exc)

        return behavior

    def stream_stream(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(inner):  # writes with context.write: awaited like stream-unary
            return self.stream_unary(inner)

        async def generate(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                try:
                    async for reply in inner(requests, context):
                        yield reply
                except UndecodableMessage as exc:
                    await self._refuse(context, status_message(exc))
            except grpc.aio.AbortError:
                self._aborted(context)
                raise
            except Exception as exc:  # noqa: BLE001
                await self._fail(context, exc)

        return generate


class _SafeGenericHandler(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, deserializers: Mapping[str, Callable[[bytes], Any]],
                 serializers: Mapping[str, Callable[[Any], bytes]], errors: CallErrors) -> None:
        self._inner = inner
        self._deserializers = deserializers
        self._serializers = serializers
        self._errors = errors
        self._wrapped: dict[str, grpc.RpcMethodHandler | None] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method not in self._wrapped:
            handler = self._inner.service(handler_call_details)
            self._wrapped[method] = (wrap_handler(handler, self._errors, method, self._deserializers.get(method),
                                                  self._serializers.get(method))
                                     if handler is not None else None)
        return self._wrapped[method]


class SafeRegistrar:
    """Pass as the ``server`` to ``add_*_to_server`` functions: registers on ``server`` with
    every method handler wrapped (see the module docstring), reporting to ``errors``.
    ``deserializers`` maps a method's full name (``/package.Service/Method``) to a deserializer
    used instead of its generated one, ``serializers`` to a response serializer."""

    def __init__(self, server: grpc.aio.Server, errors: CallErrors,
                 deserializers: Mapping[str, Callable[[bytes], Any]] | None = None,
                 serializers: Mapping[str, Callable[[Any], bytes]] | None = None) -> None:
        self._server = server
        self._errors = errors
        self._deserializers = dict(deserializers or {})
        self._serializers = dict(serializers or {})

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_SafeGenericHandler(h, self._deserializers, self._serializers, self._errors) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(service, {
            m: wrap_handler(h, self._errors, f"/{service}/{m}", self._deserializers.get(f"/{service}/{m}"),
                            self._serializers.get(f"/{service}/{m}"))
            for m, h in handlers.items()})
