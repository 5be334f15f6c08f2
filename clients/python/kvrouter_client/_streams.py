"""A small pool of ``RouteStream`` calls that RouterClient's route()/complete() share.

One long-lived bidi stream carries many Route and Complete messages, each tagged with an
id the answer echoes, so a call costs the router a stream message rather than a whole
unary RPC (on grpc.aio that is the larger part of a Route's CPU). Calls are spread over
the pool's streams in turn; each stream has one reader task that hands answers to the
waiting callers.

A stream that breaks (router restart, connection loss) fails the calls waiting on it with
the stream's status and is replaced by a new one on the next call, so reconnecting needs
nothing from the caller. A router that predates RouteStream answers UNIMPLEMENTED: the
pool then says ``unsupported`` and the client goes back to unary calls.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc

from ._errors import KVRouterClientError, RouterUnavailable, from_rpc_error, from_status
from ._generated.kvrouter.v1 import router_pb2 as pb

__all__ = ["RouteStreams", "StreamsUnsupported"]

_METHOD = "/kvrouter.v1.KVRouter/RouteStream"


class StreamsUnsupported(Exception):
    """The router has no RouteStream (UNIMPLEMENTED); the caller should use unary calls."""


class _Stream:
    """One RouteStream call and the callers waiting for its answers."""

    def __init__(self, method: grpc.aio.StreamStreamMultiCallable) -> None:
        self.call = method()  # no deadline: the stream lives as long as the connection
        self.waiting: dict[int, asyncio.Future[pb.RouteStreamResponse]] = {}
        self.write_lock = asyncio.Lock()  # grpc allows one write in flight per call
        self.failure: BaseException | None = None
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        failure: BaseException
        try:
            while True:
                reply = await self.call.read()
                if reply is grpc.aio.EOF:
                    failure = RouterUnavailable("RouteStream: the router ended the stream", grpc.StatusCode.UNAVAILABLE)
                    break
                future = self.waiting.pop(reply.id, None)
                if future is not None and not future.done():  # None: its caller gave up
                    future.set_result(reply)
        except grpc.RpcError as exc:
            failure = _stream_failure(exc)
        except asyncio.CancelledError:
            failure = RouterUnavailable("RouteStream: the client was closed", grpc.StatusCode.CANCELLED)
        self._fail(failure)

    def _fail(self, failure: BaseException) -> None:
        self.failure = failure
        waiting, self.waiting = self.waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(failure)

    async def exchange(self, message: pb.RouteStreamRequest) -> pb.RouteStreamResponse:
        if self.failure is not None:
            raise self.failure
        future: asyncio.Future[pb.RouteStreamResponse] = asyncio.get_running_loop().create_future()
        self.waiting[message.id] = future
        try:
            async with self.write_lock:
                await self.call.write(message)
            return await future
        except grpc.RpcError as exc:  # the write found the call finished
            raise _stream_failure(exc) from None
        finally:
            self.waiting.pop(message.id, None)

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()


def _stream_failure(exc: grpc.RpcError) -> BaseException:
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return StreamsUnsupported(exc.details())
    return from_rpc_error(exc, "RouteStream")


class RouteStreams:
    """``size`` RouteStream calls on one channel, opened on first use and after a break."""

    def __init__(self, channel: grpc.aio.Channel, size: int) -> None:
        if size < 1:
            raise ValueError("a stream pool needs at least one stream")
        self._method = channel.stream_stream(
            _METHOD,
            request_serializer=pb.RouteStreamRequest.SerializeToString,
            response_deserializer=pb.RouteStreamResponse.FromString,
        )
        self._streams: list[_Stream | None] = [None] * size
        self._turn = itertools.cycle(range(size))
        self._ids = itertools.count(1)
        #: the router answered UNIMPLEMENTED: it has no RouteStream
        self.unsupported = False

    async def exchange(self, message: pb.RouteStreamRequest, timeout: float, what: str) -> pb.RouteStreamResponse:
        """Send one message and wait at most ``timeout`` s for its answer.

        Raises RouterUnavailable (stream broken, router unreachable, deadline passed),
        StreamsUnsupported, or the error the router answered this message with."""
        slot = next(self._turn)
        stream = self._streams[slot]
        if stream is None or stream.failure is not None:
            if stream is not None:
                stream.close()
            stream = self._streams[slot] = _Stream(self._method)
        message.id = next(self._ids)
        message.timeout_ms = timeout * 1000.0
        try:
            reply = await asyncio.wait_for(stream.exchange(message), timeout)
        except TimeoutError:
            raise RouterUnavailable(f"{what}: DEADLINE_EXCEEDED: no answer within {timeout:g} s",
                                    grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except StreamsUnsupported:
            self.unsupported = True
            raise
        if reply.WhichOneof("kind") == "error":
            raise _reply_error(reply.error, what)
        return reply

    def close(self) -> None:
        for stream in self._streams:
            if stream is not None:
                stream.close()
        self._streams = [None] * len(self._streams)


def _reply_error(error: pb.StreamError, what: str) -> KVRouterClientError:
    return from_status(_CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.message, what)


_CODES = {code.value[0]: code for code in grpc.StatusCode}
