"""A small pool of ``RouteStream`` calls that RouterClient's route()/complete() share.

One long-lived bidi stream carries many Route and Complete messages, each tagged with an
id the answer echoes, so a call costs the router a stream message rather than a whole
unary RPC (on grpc.aio that is the larger part of a Route's CPU). Calls are spread over
the pool's streams in turn; each stream has one reader task that hands answers to the
waiting callers.

Coalescing: a stream message still costs the router ~180 us of grpc.aio CPU, more than its
own routing work, so when the router advertises batches (``kvrouter-stream-batch`` in the
stream's response metadata, its value the most bytes a message may have) the calls that are
ready to go together leave as one batch message, answered by one batch. Nothing waits for
company: a call's message is queued and a writer task sends the queue at its next turn of
the event loop, so it carries whatever the calls woken in the same turn added (with many
calls in flight, answers arriving in one batch wake their callers together); while a write
is under way new calls queue behind it and go in the next one. A lone call leaves alone, on
the loop's next turn. A call joins the batch forming on a stream rather than taking the next
stream in turn, so a burst of calls is one message and the bursts rotate over the pool. Until
the metadata arrives, and always with a router that does not advertise batches, every call is
its own message on the next stream in turn, as before.

Block keys: a router that takes them also advertises the block size it keys prompts with
(``kvrouter-block-size``); a Route made with ``keyed`` (``RouterClient(send_block_keys=True)``)
goes as its block keys on a stream that has seen it, as its token ids on any other.

A stream that breaks (router restart, connection loss) fails the calls waiting on it with
the stream's status and is replaced by a new one on the next call, so reconnecting needs
nothing from the caller. A router that predates RouteStream answers UNIMPLEMENTED: the
pool then says ``unsupported`` and the client goes back to unary calls.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import grpc

from ._decimals import parse_decimal
from ._errors import KVRouterClientError, RouterUnavailable, from_rpc_error, from_status
from ._generated.kvrouter.v1 import router_pb2 as pb

# batch_message, batches and advertised_limit are the coalescing policy, which kvrouterd's bench reuses
__all__ = [
    "COMPLETE", "MAX_BATCH_BYTES", "MAX_BATCH_ITEMS", "ROUTE", "RouteStreams", "StreamsUnsupported",
    "advertised_block_size", "advertised_limit", "batch_message", "batches", "field_header", "stream_item",
    "varint_field",
]

_METHOD = "/kvrouter.v1.KVRouter/RouteStream"
#: RouteStream response metadata of a router that takes batches; its value: its message size limit
BATCH_METADATA = "kvrouter-stream-batch"
#: RouteStream response metadata: the block size the router keys prompts with
BLOCK_SIZE_METADATA = "kvrouter-block-size"
#: most calls in one batch: the router answers a batch once all its items are decided, so the
#: size bounds how long the first item's answer waits for the others (~64 x 100 us)
MAX_BATCH_ITEMS = 64
#: most bytes in one batch, below whatever the router advertises (a batch is one message in
#: memory on both ends); a call larger than a batch may be still goes, alone
MAX_BATCH_BYTES = 4 << 20
#: bytes a batch adds around each item (tag + length) and around itself
_FRAMING = 6
#: RouteStreamRequest's kinds a call sends: their field numbers in its ``kind`` oneof
ROUTE = 2
COMPLETE = 3
#: RouteStreamRequest.id (field 1, varint) and .timeout_ms (field 4, 64-bit) tags
_ID_TAG = b"\x08"
_TIMEOUT_TAG = b"\x21"
_DOUBLE = struct.Struct("<d")


class StreamsUnsupported(Exception):
    """The router has no RouteStream (UNIMPLEMENTED); the caller should use unary calls."""


class _NeverSent(Exception):
    """The stream failed (``failure``) before this message left the client: it was still queued,
    or the write carrying it failed. The router never saw it, so it may go again on a new stream."""

    def __init__(self, failure: BaseException) -> None:
        super().__init__(str(failure))
        self.failure = failure


def _varint(n: int) -> bytes:
    if n < 0x80:  # a tag, a small id: one byte, on every call
        return _ONE_BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_ONE_BYTE = tuple(bytes((i,)) for i in range(0x80))


def varint_field(number: int, value: int) -> bytes:
    """A varint field (``value`` >= 0) on the wire: its tag and its value."""
    return _varint(number << 3) + _varint(value)


def field_header(number: int, size: int) -> bytes:
    """The tag and length that precede a length-delimited field (bytes, string, message) of
    ``size`` bytes on the wire."""
    return _varint(number << 3 | 2) + _varint(size)


def stream_item(n: int, kind: int, body: Sequence[bytes | memoryview], timeout_ms: float) -> bytes:
    """The serialised ``RouteStreamRequest(id=n, <kind>=request, timeout_ms=timeout_ms)``, byte
    for byte what protobuf encodes, where ``body``'s parts joined are the serialised request.

    Built by concatenation (a message field is its tag, its length and its bytes) so that a
    Route's prompt is copied once, here, rather than into a RouteRequest, again into the
    RouteStreamRequest holding it and again when that is serialised."""
    head = _ID_TAG + _varint(n) + field_header(kind, sum(map(len, body)))
    if not timeout_ms:  # proto3 leaves a zero out
        return b"".join((head, *body))
    return b"".join((head, *body, _TIMEOUT_TAG, _DOUBLE.pack(timeout_ms)))


def batch_message(items: list[bytes]) -> bytes:
    """Serialised RouteStreamRequests as one serialised RouteStreamRequest whose ``batch``
    holds them. Built by concatenation (protobuf encodes a message field as tag, length,
    bytes) in one join, so no item is parsed, encoded or copied twice: a batch of prompts is
    hundreds of KiB, and every extra copy of it costs the gateway a page-faulting allocation."""
    parts: list[bytes] = [b""]
    size = 0
    for item in items:
        header = b"\x0a" + _varint(len(item))  # batch.items: field 1
        parts.append(header)
        parts.append(item)
        size += len(header) + len(item)
    parts[0] = b"\x2a" + _varint(size)  # RouteStreamRequest.batch: field 5
    return b"".join(parts)


def advertised_limit(metadata: grpc.aio.Metadata | None) -> int:
    """The batch size in bytes this stream may send: 0 unless the router advertises batches."""
    value = metadata.get(BATCH_METADATA) if metadata is not None else None
    limit = parse_decimal(value) if isinstance(value, str) else None
    return min(limit, MAX_BATCH_BYTES) if limit is not None else 0


def advertised_block_size(metadata: grpc.aio.Metadata | None) -> int:
    """The block size the router keys prompts with: 0 unless it advertises one."""
    value = metadata.get(BLOCK_SIZE_METADATA) if metadata is not None else None
    size = parse_decimal(value) if isinstance(value, str) else None
    return size or 0


def batches(queued: list[bytes], limit: int) -> Iterator[list[bytes]]:
    """``queued`` cut, in order, into runs of at most MAX_BATCH_ITEMS items and ``limit`` bytes."""
    run: list[bytes] = []
    size = _FRAMING
    for payload in queued:
        cost = len(payload) + _FRAMING
        if run and (len(run) == MAX_BATCH_ITEMS or size + cost > limit):
            yield run
            run, size = [], _FRAMING
        run.append(payload)
        size += cost
    if run:
        yield run


def wire_messages(payloads: list[bytes], limit: int) -> Iterator[tuple[bytes, int]]:
    """What goes on the wire for ``payloads`` (serialised RouteStreamRequests), each message
    with how many calls it carries: batches of at most ``limit`` bytes (``batches``), a run of
    one as itself; one message per call when ``limit`` is 0 (no batches advertised)."""
    runs = batches(payloads, limit) if limit else ([p] for p in payloads)
    for run in runs:
        yield (run[0] if len(run) == 1 else batch_message(run)), len(run)


def _keep_batches_mapped(limit: int) -> None:
    """Allocate and free one buffer of ``limit`` bytes, the largest batch a stream may send.

    A batch is two buffers of up to ``limit`` bytes (the message, and gRPC's copy of it), freed
    after every write. glibc's malloc serves blocks that large with fresh mmap()s, or trims them
    off its heap when freed, until it has freed one mmap()ed block of the size (its dynamic
    threshold, mallopt(3)); until then every batch touches new pages, some 8 page faults per
    call (~15 us of CPU per Route + Complete on a VM). Freeing one such block up front moves the
    threshold past any batch, so the heap keeps its pages between writes. ``bytes(n)`` is
    calloc()ed: mapped and unmapped without touching a page. Other allocators just free it."""
    if limit:
        bytes(limit)


def answers(reply: pb.RouteStreamResponse) -> Sequence[pb.RouteStreamResponse]:
    """The answers a reply carries: a batch's items, or the reply itself."""
    return reply.batch.items if reply.WhichOneof("kind") == "batch" else (reply,)


class _Stream:
    """One RouteStream call, its queue of messages to send and the callers waiting for answers."""

    def __init__(self, method: grpc.aio.StreamStreamMultiCallable, pool: RouteStreams) -> None:
        self.call = method()  # no deadline: the stream lives as long as the connection
        #: the pool's message ids, and its count of late Routes released
        self.pool = pool
        self.waiting: dict[int, asyncio.Future[pb.RouteStreamResponse]] = {}
        #: ids of the Completes this stream sent to release late Routes: answered, no one waits
        self.releases: set[int] = set()
        #: (id, serialised message) not yet written; one writer task at a time sends them
        self.queue: list[tuple[int, bytes]] = []
        self.writer: asyncio.Task[None] | None = None
        #: the messages the writer took from the queue and has not yet written; ``writing``
        #: while a write of the first of them is under way
        self.sending: list[tuple[int, bytes]] = []
        self.writing = False
        #: bytes a batch may have; 0 = one message per call (no advertisement seen, or not yet)
        self.batch_limit = 0
        #: the block size the router keys prompts with; 0 = not advertised (or not yet): token ids
        self.block_size = 0
        self.failure: BaseException | None = None
        # kept: asyncio.get_running_loop() costs a getpid() system call, several a call otherwise
        self.loop = asyncio.get_running_loop()
        #: (deadline, id, what, timeout) of calls sent, in deadline order: one timer per stream
        #: (``_expire_due``) fails those still waiting at their deadline, where a timer per call
        #: cost ~1.6 us to arm and cancel. Answered calls leave from the front as calls are added
        self.deadlines: deque[tuple[float, int, str, float]] = deque()
        self.deadline_timer: asyncio.TimerHandle | None = None
        self.deadline_at = 0.0  # when deadline_timer fires
        self.reader = self.loop.create_task(self._read())

    async def _read(self) -> None:
        failure: BaseException
        waiting = self.waiting
        try:
            # a batching router sends its metadata at once; an older one with its first answer
            metadata = await self.call.initial_metadata()
            self.batch_limit = advertised_limit(metadata)
            self.block_size = advertised_block_size(metadata)
            _keep_batches_mapped(self.batch_limit)
            while True:
                reply = await self.call.read()
                if reply is grpc.aio.EOF:
                    failure = RouterUnavailable("RouteStream: the router ended the stream", grpc.StatusCode.UNAVAILABLE)
                    break
                for answer in answers(reply):
                    future = waiting.pop(answer.id, None)
                    if future is not None and not future.done():
                        future.set_result(answer)
                    elif answer.id in self.releases:
                        self.releases.discard(answer.id)
                    elif answer.WhichOneof("kind") == "route":  # its caller gave up: nobody sends it
                        self._release(answer.route.request_id)
        except grpc.RpcError as exc:
            failure = _stream_failure(exc)
        except asyncio.CancelledError:  # closed: nothing goes again
            self._fail(RouterUnavailable("RouteStream: the client was closed", grpc.StatusCode.CANCELLED), closed=True)
            return
        self._fail(failure)

    def _release(self, request_id: str) -> None:
        """A Route answered after its caller's deadline (the router was busy: a long event
        batch, a collection) was committed: the router charges its worker a request nobody
        sends there, for its in-flight timeout (300 s by default), and a retry under the same id
        is refused as already in flight. A Complete with ``success=False`` releases it, sent
        on this stream behind the Route, so the router has committed it before it reads this."""
        n = next(self.pool.ids)
        item = stream_item(n, COMPLETE, [pb.CompleteRequest(request_id=request_id, success=False,
                                                             cached_tokens=-1).SerializeToString()], 0.0)
        self.releases.add(n)
        self.queue.append((n, item))
        self.pool.late_routes_released += 1
        if self.writer is None:
            self.writer = self.loop.create_task(self._write())

    def _fail(self, failure: BaseException, closed: bool = False) -> None:
        """Fail every call waiting on the stream with ``failure``; unless the client ``closed``
        it, those whose messages never left (still queued, or taken by a write that failed)
        with it as ``_NeverSent``, so they may go again. A write under way holds its messages:
        whether they left is known when it returns, and ``_write`` settles them then."""
        if self.failure is None:
            self.failure = failure
        held = () if closed or not self.writing else {n for n, _ in self.sending}
        never_sent = set() if closed else {n for n, _ in self.queue}.union(n for n, _ in self.sending)
        waiting, self.waiting = self.waiting, {}
        self.releases = set()
        self.queue = []
        if not held:
            self.sending = []
        for n, future in waiting.items():
            if n in held:
                self.waiting[n] = future
            elif not future.done():
                future.set_exception(_NeverSent(self.failure) if n in never_sent else self.failure)

    async def _write(self) -> None:
        """Send the queue until it is empty: messages queued while a write is under way go in
        the next one, together when the router takes batches."""
        write = self.call.write
        try:
            while self.queue and self.failure is None:
                queued, self.queue = self.queue, []
                # a caller that gave up (deadline) before its message left costs the router nothing
                self.sending = [item for item in queued if item[0] in self.waiting or item[0] in self.releases]
                for message, count in wire_messages([payload for _, payload in self.sending], self.batch_limit):
                    self.writing = True
                    try:
                        await write(message)
                    finally:
                        self.writing = False
                    del self.sending[:count]
                    if self.failure is not None:
                        # the stream failed during the write: the calls it wrote fail with the
                        # stream (``_fail`` kept them waiting), the rest never left
                        self._fail(self.failure)
                        return
        except grpc.RpcError as exc:
            # the write found the call finished. gRPC's core fails a message it could not send
            # as INTERNAL "Internal error from Core" and that status replaces the one the router
            # ended the call with (an UNIMPLEMENTED from a router without RouteStream, ~1% of
            # first calls on loopback): the messages of this write never left, so they go again
            self._fail(_stream_failure(exc))
        except asyncio.InvalidStateError:
            # the call had ended before this write began; its status is the router's own, which
            # the reader fails the stream with (the messages it finds queued as never sent)
            if self.failure is not None:
                self._fail(self.failure)
            else:
                self.queue[:0] = self.sending
                self.sending = []
        finally:
            self.writer = None

    def submit(self, n: int, item: bytes) -> asyncio.Future[pb.RouteStreamResponse]:
        """Queue ``item``, the serialised message of id ``n``; the future gets its answer. The
        caller pops ``waiting`` when done."""
        if self.failure is not None:
            raise self.failure
        future: asyncio.Future[pb.RouteStreamResponse] = self.loop.create_future()
        self.waiting[n] = future
        self.queue.append((n, item))
        if self.writer is None:
            # a task runs from the loop's next turn: the calls made in this turn queue first
            self.writer = self.loop.create_task(self._write())
        return future

    def expire_at(self, n: int, when: float, what: str, timeout: float) -> asyncio.TimerHandle | None:
        """Fail call ``n`` with DEADLINE_EXCEEDED if it is still waiting at ``when`` (the loop's
        clock), ``timeout`` s after it was made. Returns the timer the caller must cancel when
        done, if the call needed one of its own."""
        deadlines, waiting = self.deadlines, self.waiting
        while deadlines and deadlines[0][1] not in waiting:  # answered (calls finish about in order)
            deadlines.popleft()
        if deadlines and when < deadlines[-1][0]:
            # sooner than a call before it (a shorter per-call timeout): a timer of its own
            return self.loop.call_at(when, _expire, waiting[n], what, timeout)
        deadlines.append((when, n, what, timeout))
        if self.deadline_timer is None or when < self.deadline_at:  # the timer may be a gone call's
            self._arm(when)
        return None

    def _arm(self, when: float) -> None:
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()
        self.deadline_timer = self.loop.call_at(when, self._expire_due)
        self.deadline_at = when

    def _expire_due(self) -> None:
        now = self.loop.time()
        deadlines, waiting = self.deadlines, self.waiting
        while deadlines and deadlines[0][0] <= now:
            _, n, what, timeout = deadlines.popleft()
            future = waiting.get(n)
            if future is not None:
                _expire(future, what, timeout)
        # the next no sooner than a millisecond on (the loop's timers have that resolution): a
        # deadline is kept late by at most that, never early
        self.deadline_timer = None
        if deadlines:
            self._arm(max(deadlines[0][0], now + 0.001))

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        if self.writer is not None:
            self.writer.cancel()
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()


#: whole-call codes that mean the stream broke, not that the router refused something
_STREAM_BROKE = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


def _stream_failure(exc: grpc.RpcError) -> BaseException:
    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return StreamsUnsupported(exc.details())
    if code in _STREAM_BROKE:
        # the router answers a message it refuses or fails on in-band (a StreamError under
        # its id), so a whole call ending INTERNAL/UNKNOWN is the stream breaking: gRPC's core
        # ends it "Internal error from Core" when the router goes away with a message in
        # flight. Nothing refused the request: it may fail open, and the next call opens anew
        return RouterUnavailable(f"RouteStream: the stream broke: {code.name}: {exc.details()}", code)
    return from_rpc_error(exc, "RouteStream")


class RouteStreams:
    """``size`` RouteStream calls on one channel, opened on first use and after a break."""

    def __init__(self, channel: grpc.aio.Channel, size: int) -> None:
        if size < 1:
            raise ValueError("a stream pool needs at least one stream")
        self._method = channel.stream_stream(
            _METHOD,
            request_serializer=bytes,  # _Stream serialises each message itself, to batch the bytes
            response_deserializer=pb.RouteStreamResponse.FromString,
        )
        self._streams: list[_Stream | None] = [None] * size
        #: the stream whose queued batch new calls join while its writer has not taken it
        self._filling: _Stream | None = None
        self._turn = itertools.cycle(range(size))
        #: message ids, unique over the pool's streams
        self.ids = itertools.count(1)
        #: Routes answered after their callers gave up, released with a Complete (``_Stream._release``)
        self.late_routes_released = 0
        #: the router answered UNIMPLEMENTED: it has no RouteStream
        self.unsupported = False

    async def exchange(
        self, kind: int, body: Sequence[bytes | memoryview] | Callable[[int], Sequence[bytes | memoryview]],
        timeout: float, what: str, resent: bool = False,
    ) -> pb.RouteStreamResponse:
        """Send one message of ``kind`` (ROUTE or COMPLETE) carrying the serialised request
        ``body`` (its parts, joined once: see ``stream_item``) and wait at most ``timeout`` s
        for its answer. A callable ``body`` is given the block size the stream's router
        advertised (0: none) and makes the parts (a Route's block keys, or its token ids).
        A message the stream failed before sending goes once more on a new stream (``resent``
        marks that second try), within the same ``timeout``.

        Raises RouterUnavailable (stream broken, router unreachable, deadline passed),
        StreamsUnsupported, or the error the router answered this message with."""
        if timeout <= 0:  # past its deadline before it leaves: the router never sees it
            raise _deadline_exceeded(what, timeout)
        stream = self._filling
        if stream is None or not stream.queue or not stream.batch_limit or stream.failure is not None:
            # no batch forming: the next stream in turn (calls made together join the batch the
            # first of them started, so a burst leaves as one message; bursts rotate over the pool)
            slot = next(self._turn)
            stream = self._streams[slot]
            if stream is None or stream.failure is not None:
                if stream is not None:
                    stream.close()
                stream = self._streams[slot] = _Stream(self._method, self)
            self._filling = stream
        n = next(self.ids)
        parts = body(stream.block_size) if callable(body) else body
        item = stream_item(n, kind, parts, timeout * 1000.0)
        timer: asyncio.TimerHandle | None = None
        when = stream.loop.time() + timeout
        try:
            future = stream.submit(n, item)
            # the deadline fails the future itself: cheaper than wait_for's wrapping future and
            # callbacks, and a cancelled caller still cancels the future it awaits
            timer = stream.expire_at(n, when, what, timeout)
            reply = await future
        except StreamsUnsupported:
            self.unsupported = True
            raise
        except _NeverSent as unsent:
            failure = unsent.failure
            if isinstance(failure, StreamsUnsupported):
                self.unsupported = True
                raise failure from None
            left = when - stream.loop.time()
            if resent or left <= 0:
                raise failure from None
            reply = None  # the router never saw it: once more, on a new stream
        finally:
            if timer is not None:
                timer.cancel()
            stream.waiting.pop(n, None)
        if reply is None:
            return await self.exchange(kind, body, left, what, resent=True)
        if reply.WhichOneof("kind") == "error":
            raise _reply_error(reply.error, what)
        return reply

    def close(self) -> None:
        for stream in self._streams:
            if stream is not None:
                stream.close()
        self._streams = [None] * len(self._streams)
        self._filling = None


def _deadline_exceeded(what: str, timeout: float) -> RouterUnavailable:
    return RouterUnavailable(f"{what}: DEADLINE_EXCEEDED: no answer within {timeout:g} s",
                             grpc.StatusCode.DEADLINE_EXCEEDED)


def _expire(future: asyncio.Future[pb.RouteStreamResponse], what: str, timeout: float) -> None:
    if not future.done():
        future.set_exception(_deadline_exceeded(what, timeout))


def _reply_error(error: pb.StreamError, what: str) -> KVRouterClientError:
    return from_status(_CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.message, what)


_CODES = {code.value[0]: code for code in grpc.StatusCode}
