"""Engines' side: publish KV-cache events to kvrouterd, ask for eviction advice, report load.

    async with EventPublisher("kvrouter:50051", "gpu-0", block_size=16, snapshot=cache_snapshot) as pub:
        await pub.register("10.0.0.5:8000", capacity_blocks=20_000)
        pub.stored(tokens, engine_hashes=hashes, parent_engine_hash=parent)   # never blocks
        pub.removed(evicted_hashes)
        advice = await pub.evict_hint(blocks=64)

Delivery. Events are recorded without waiting, batched (up to ``max_batch_events`` events or
``linger_s`` seconds) and numbered 0, 1, 2, ... per publisher, the router's per-worker sequence.
Every batch is cut to fit the router's limits on one batch (``max_event_batch_bytes``,
``max_batch_blocks``: pass the router's if it lowered them): a long stored chain becomes several
chained ones in consecutive batches, which leave the router's index as the whole chain would
(``_batches``).
Batches go over ``PublishEvents`` client streams; a stream is closed every ``ack_interval_s``
(or on ``flush()``) and its summary acknowledges everything written on it. Until then each
batch stays buffered, and after a failure (router down, restarted, network) the publisher
reconnects and resends every unacknowledged batch; the router ignores numbers it already
applied, so nothing is lost or applied twice. A broken connection is waited out on the
channel itself: gRPC retries the connection every ``reconnect_initial_s`` growing up to
``CONNECT_BACKOFF_MAX_S`` (0.5 s), and the publisher goes on the moment it is up again, first
reading the router's epoch (the router may have restarted behind the broken connection).
``reconnect_initial_s`` .. ``reconnect_max_s`` bound the backoff between streams the router
ended with an error while connected (NOT_FOUND, ...), by the SDK's schedule (``_backoff``).

Overflow. At most ``max_buffered_batches`` batches are held. Beyond that the buffer is
dropped, the overflow is reported (log, ``stats.overflows``, ``on_overflow(events_dropped)``),
and new events are dropped until the router is reachable again. Then the publisher sends
``Cleared`` followed by ``snapshot()`` (the engine's current GPU cache as ``Stored`` chains,
parents first) under the next sequence number: the router counts the gap, then the Cleared
resyncs the worker. Without a ``snapshot`` the router's view restarts empty and refills from
later events. A batch the router rejects (bad input, over a limit) is handled the same way,
since resending it would fail forever. NOT_FOUND (this worker is not registered yet) is not a
rejection: engines often start before they register, so the batches stay buffered and retried.
Nor is a connection that broke: gRPC's client side ends the stream UNAVAILABLE, or INTERNAL
when a write was in flight, statuses no router sent. An INTERNAL or UNKNOWN (which a router
also answers for a bug of its own) therefore counts as a rejection only when the next stream,
over a working connection, ends the same way.

A publisher numbers from 0, which the router reads as an engine restart (it clears this
worker's view): create one per engine process lifetime, not one per connection. Batch 0 is
sent and acknowledged on its own, so it is only resent if its stream broke before the
acknowledgement; the router then clears and rebuilds the view from the resent batches
(the end state is right; one extra restart is counted).

Router restarts. Each PublishEvents answer carries the router's epoch (drawn at its start)
and, per worker the stream named, whether its view needs a resync. The view does after a
router restart, a warm-up from a peer or a re-registration (the router never saw this
publisher's earlier batches) and after a gap; the publisher then sends ``Cleared`` plus
``snapshot()`` by itself, numbered right after the last batch it wrote (the numbers of
buffered batches the snapshot supersedes are reused). A publisher sends an empty stream to
read the epoch whenever its connection comes back after breaking, and while idle every
``probe_interval_s`` (0: neither); a new epoch means the router restarted:
the worker is registered again (if this publisher registered it) and resynced. A NOT_FOUND
is checked the same way, so a worker an operator deregistered stays deregistered while the
router runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

import grpc

from ._backoff import Backoff
from ._batches import (
    DEFAULT_MAX_BATCH_BLOCKS,
    DEFAULT_MAX_EVENT_BATCH_BYTES,
    BatchLimits,
    check_limits,
    check_stored_fits,
    pack_batches,
)
from ._channel import CONNECT_BACKOFF_MAX_S, TLS, channel_options, open_aio_channel
from ._client import DEFAULT_TIMEOUT_S
from ._errors import RouterRejected, RouterUnavailable, from_rpc_error
from ._generated.kvrouter.v1 import router_pb2 as pb
from ._generated.kvrouter.v1 import router_pb2_grpc
from ._types import (
    Cleared,
    Event,
    PublisherStats,
    Removed,
    Stored,
    event_to_pb,
    validate_stored,
)
from ._worker_calls import WorkerCalls

__all__ = ["EventPublisher", "SnapshotFn"]

log = logging.getLogger("kvrouter_client.publisher")

#: the engine's current GPU cache as Stored chains, parents before children
SnapshotFn = Callable[[], Iterable[Stored]]

#: what gRPC's client side also ends a stream with when the connection under it dies (a write
#: in flight fails inside gRPC's core: INTERNAL "Internal error from Core"), and a router with a
#: bug of its own: a rejection only if a second stream ends the same way
_TRANSPORT_OR_ROUTER = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling again while it runs: Python 3.11's
    ``asyncio.wait_for`` can lose a cancellation that arrives as its inner await completes
    (CPython gh-86296), and the publisher's loops wait that way, so one cancel may not end them
    and awaiting the task once could hang ``close()`` for good (a CI run hung 300 s here)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled() and (exc := task.exception()) is not None:
        raise exc  # what awaiting the task raised before


class EventPublisher(WorkerCalls):
    """Publishes one worker's cache events and speaks for that worker to the router."""

    #: events go over PublishEvents; NatsEventPublisher sends them to the bus instead
    _events_need_router = True

    def __init__(
        self,
        target: str = "",
        worker_id: str = "",
        *,
        channel: grpc.aio.Channel | None = None,
        block_size: int = 16,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_batch_events: int = 512,
        max_event_batch_bytes: int = DEFAULT_MAX_EVENT_BATCH_BYTES,
        max_batch_blocks: int = DEFAULT_MAX_BATCH_BLOCKS,
        linger_s: float = 0.005,
        ack_interval_s: float = 0.5,
        max_buffered_batches: int = 10_000,
        snapshot: SnapshotFn | None = None,
        on_overflow: Callable[[int], None] | None = None,
        reconnect_initial_s: float = 0.05,
        reconnect_max_s: float = 5.0,
        probe_interval_s: float = 5.0,
        options: Sequence[tuple[str, Any]] = (),
        tls: TLS | None = None,
        token: str | None = None,
        token_file: str | None = None,
    ) -> None:
        if channel is None and not target and self._events_need_router:
            raise ValueError("pass a target (host:port) or a channel")
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        for name, value in (("block_size", block_size), ("max_batch_events", max_batch_events),
                            ("max_buffered_batches", max_buffered_batches)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name, fvalue in (("timeout", timeout), ("ack_interval_s", ack_interval_s),
                             ("reconnect_initial_s", reconnect_initial_s)):
            if fvalue <= 0:
                raise ValueError(f"{name} must be > 0, got {fvalue}")
        if linger_s < 0 or reconnect_max_s < reconnect_initial_s or probe_interval_s < 0:
            raise ValueError("linger_s and probe_interval_s must be >= 0 and reconnect_max_s >= reconnect_initial_s")
        self.worker_id = worker_id
        self.block_size = block_size
        self.timeout = timeout
        self.max_batch_events = max_batch_events
        #: what one batch may carry: the router's limits (events are cut to fit, ``_batches``)
        self.batch_limits = BatchLimits(max_batch_events, max_batch_blocks, max_event_batch_bytes)
        check_limits(self.batch_limits, block_size, worker_id)
        self.linger_s = linger_s
        self.ack_interval_s = ack_interval_s
        self.max_buffered_batches = max_buffered_batches
        self.snapshot = snapshot
        self.on_overflow = on_overflow
        self.reconnect_initial_s = reconnect_initial_s
        self.reconnect_max_s = reconnect_max_s
        self._backoff = Backoff(reconnect_initial_s, reconnect_max_s)
        #: seconds of idleness between two reads of the router's epoch (0 = never probe)
        self.probe_interval_s = probe_interval_s
        self._own_channel = channel is None and bool(target)
        self._channel = channel or (open_aio_channel(
            target, channel_options(options, reconnect_initial_s, min(reconnect_max_s, CONNECT_BACKOFF_MAX_S)), tls,
            token, token_file) if target else None)
        self._stub = router_pb2_grpc.KVRouterStub(self._channel) if self._channel is not None else None
        self.stats = PublisherStats()
        self._pending: list[Event] = []
        self._buffer: deque[tuple[int, pb.EventBatch]] = deque()
        self._next_seq = 0
        #: highest batch number ever written to a router (numbers above it are free to reuse)
        self._written_seq = -1
        #: the router's epoch from its last answer (0 = none yet, or a router without epochs)
        self._router_epoch = 0
        #: what register() was last called with, repeated after a router restart
        self._registration: dict[str, Any] | None = None
        self._reregister = False
        #: read the router's epoch before the next stream (after NOT_FOUND, or a first register())
        self._check_epoch = False
        #: why a router (over the event bus) asked for a resync; acted on at the next safe point
        self._resync_asked = ""
        #: number of the Cleared batch of the latest resync (-1 = none)
        self._last_resync_seq = -1
        self._needs_resync = False
        self._flush_now = False
        self._wake = asyncio.Event()
        self._acked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        #: INTERNAL or UNKNOWN if the last stream ended so (a broken connection, or the router's own)
        self._ambiguous_failure: grpc.StatusCode | None = None

    # ---- recording (never blocks) -----------------------------------------------------------
    def stored(
        self,
        token_ids: Sequence[int],
        *,
        engine_hashes: Sequence[int] | None = None,
        parent_engine_hash: int | None = None,
        model: str = "",
        lora: str = "",
        cache_salt: str = "",
    ) -> None:
        """The engine cached full blocks (all their tokens, back to back), for ``model`` /
        ``lora`` under the request's ``cache_salt``. Raises ValueError for input the router would
        reject, so a bad event never poisons the stream."""
        ev = Stored(list(token_ids), None if engine_hashes is None else list(engine_hashes), parent_engine_hash,
                    model, lora, cache_salt)
        validate_stored(ev, self.block_size)
        check_stored_fits(ev, self.block_size, self.batch_limits, self.worker_id)
        self._record(ev)

    def removed(self, engine_hashes: Sequence[int]) -> None:
        """The engine evicted these blocks (its hashes, or kvrouterd keys if it uses those)."""
        hashes = list(engine_hashes)
        if any(not 0 <= h < 2**64 for h in hashes):
            raise ValueError("engine hashes must be unsigned 64-bit ints")
        self._record(Removed(hashes))

    def cleared(self) -> None:
        """The engine dropped its whole prefix cache."""
        self._record(Cleared())

    def _record(self, ev: Event) -> None:
        if self._needs_resync:
            self.stats.events_dropped += 1  # the resync snapshot describes the state after it
            return
        self._pending.append(ev)
        self.stats.events_recorded += 1
        if len(self._pending) >= self.max_batch_events:
            self._seal()
        self._wake.set()

    def _seal(self) -> None:
        if not self._pending:
            return
        if len(self._buffer) >= self.max_buffered_batches:
            self._overflow()
            return
        self._append_batch(self._pending)
        self._pending = []

    def _append_batch(self, events: Sequence[Event]) -> None:
        """Number and buffer ``events`` as one batch, or as consecutive ones where they do not
        fit the router's limits on one (``pack_batches``)."""
        for part in pack_batches(events, self.block_size, self.batch_limits, self.worker_id):
            seq = self._next_seq
            self._next_seq += 1
            msg = pb.EventBatch(worker_id=self.worker_id, sequence=seq, timestamp=time.time(),
                                events=[event_to_pb(e, self.block_size) for e in part])
            self._buffer.append((seq, msg))
            self.stats.batches_sealed += 1

    def _overflow(self) -> None:
        dropped = sum(len(msg.events) for _, msg in self._buffer) + len(self._pending)
        self._drop_for_resync(dropped)
        self.stats.overflows += 1
        log.warning(
            "event buffer full (%d batches): %d events dropped; will send Cleared + resync when the router is reachable",
            self.max_buffered_batches, dropped, extra={"worker_id": self.worker_id},
        )
        if self.on_overflow is not None:
            self.on_overflow(dropped)

    def _drop_for_resync(self, dropped: int) -> None:
        self.stats.events_dropped += dropped
        self._buffer.clear()
        self._pending = []
        self._needs_resync = True
        self._wake.set()

    def _resync(self) -> None:
        """Queue Cleared + the engine's snapshot as the next batches."""
        events: list[Event] = [Cleared()]
        self._last_resync_seq = self._next_seq
        if self.snapshot is not None:
            try:
                for ev in self.snapshot():
                    validate_stored(ev, self.block_size)
                    check_stored_fits(ev, self.block_size, self.batch_limits, self.worker_id)
                    events.append(ev)
            except Exception:  # a broken snapshot must not stop the publisher; Cleared alone is consistent
                log.exception("snapshot failed; resyncing with Cleared only", extra={"worker_id": self.worker_id})
                events = [Cleared()]
        self._append_batch(events)  # in as many batches as the limits need
        self._needs_resync = False
        self.stats.resyncs += 1

    def _resync_for_router(self, why: str) -> None:
        """The router's view of this worker is incomplete (``why``): resync it now. Every
        buffered event happened before the snapshot, which covers it, so the buffer goes; its
        unwritten numbers are reused, so the router sees Cleared right after our last batch."""
        log.warning("%s: sending Cleared + snapshot", why, extra={"worker_id": self.worker_id})
        self.stats.resyncs_requested += 1
        self._buffer.clear()
        self._pending = []
        self._next_seq = self._written_seq + 1
        self._resync()

    def _on_answer(self, summary: pb.PublishEventsResponse) -> None:
        """Act on a PublishEvents answer: the router's batch limits, its epoch and this worker's resync flag."""
        self._adopt_limits(summary.max_event_batch_bytes, summary.max_batch_blocks)
        epoch = summary.router_epoch
        if not epoch:
            return  # a router that predates epochs: its sequence rules alone apply
        mine = next((w for w in summary.workers if w.worker_id == self.worker_id), None)
        known, self._router_epoch = self._router_epoch, epoch
        if known and known != epoch:
            self.stats.router_restarts += 1
            log.warning("router epoch changed from %016x to %016x (it restarted, or another replica answered)",
                        known, epoch, extra={"worker_id": self.worker_id})
            if mine is None:  # nothing of ours on this stream: the answer says nothing about our view
                if self._registration is not None:
                    self._reregister = True
                if self._written_seq >= 0:
                    self._resync_for_router("router restarted; its view of this worker is not ours")
                return
        if mine is not None and mine.resync_needed:
            self._resync_for_router(f"router says its view is incomplete after batch {mine.last_sequence}")

    def _adopt_limits(self, max_bytes: int, max_blocks: int) -> None:
        """Cut later batches under the router's limits where they are lower than ours (0: a router
        that does not say). Batches already cut stay as they are: one the router refuses is
        handled as any refused batch, by a resync, which is cut under the new limits."""
        ours = self.batch_limits
        limits = BatchLimits(ours.max_events, min(ours.max_blocks, max_blocks or ours.max_blocks),
                             min(ours.max_bytes, max_bytes or ours.max_bytes))
        if limits == ours:
            return
        try:
            check_limits(limits, self.block_size, self.worker_id)
        except ValueError as exc:
            log.error("the router's batch limits (%d bytes, %d blocks) cannot be used: %s", max_bytes, max_blocks, exc,
                      extra={"worker_id": self.worker_id})
            return
        log.info("cutting event batches under the router's limits: %d bytes, %d blocks", limits.max_bytes,
                 limits.max_blocks, extra={"worker_id": self.worker_id})
        self.batch_limits = limits

    @property
    def router_epoch(self) -> int:
        """The epoch of the router that last answered (0 = none yet, or it predates epochs)."""
        return self._router_epoch

    # ---- delivery -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start delivering in the background (``async with`` does this)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kvrouter-publisher-{self.worker_id}")
        if self._watch is None and self._events_need_router and self._channel is not None and self.probe_interval_s:
            self._watch = asyncio.create_task(self._watch_connection(), name=f"kvrouter-connection-{self.worker_id}")

    async def _run(self) -> None:
        # Hand-written, not a retry library's loop: after a failure with the connection down
        # it waits for the connection to come back (gRPC's connect backoff, 0.5 s at most),
        # not a time, and such a wait does not grow the backoff, which only the router's own
        # errors over a working connection do; and the loop is the delivery loop itself (wait
        # for work, probe, register, stream), not one call retried.
        failures = 0  # in a row while connected; the backoff's attempt number
        while True:
            backoff = self._backoff.delay(failures + 1)  # the wait should this round fail
            idle = not await self._wait_for_work(self._probe_after())
            try:
                if idle or self._check_epoch:
                    await self._probe()
                if self._reregister:
                    await self._register_again()
                if self._buffer or self._pending or self._needs_resync:
                    await self._stream()
                failures = 0
                self._ambiguous_failure = None
                continue
            except grpc.RpcError as exc:
                err = from_rpc_error(exc, "PublishEvents")
                self.stats.last_error = str(err)
                if self._rejection(err):
                    self.stats.rejected += 1
                    if err.code is grpc.StatusCode.RESOURCE_EXHAUSTED and self._events_need_router:
                        self._check_epoch = True  # a batch over the router's limits: read them before resending
                    log.error("router rejected an event batch (%s); resyncing", err, extra={"worker_id": self.worker_id})
                    self._drop_for_resync(sum(len(m.events) for _, m in self._buffer) + len(self._pending))
                else:
                    if self._events_need_router and (err.code is grpc.StatusCode.NOT_FOUND
                                                     or (self.probe_interval_s and not self._connected())):
                        # NOT_FOUND: a restarted router forgot us, or an operator removed us; a
                        # broken connection: the router may have restarted behind it
                        self._check_epoch = True
                    self.stats.reconnects += 1
                    log.warning("cannot publish (%s); retrying %s", err,
                                "once connected" if not self._connected() else f"in {backoff:.2f}s",
                                extra={"worker_id": self.worker_id})
            except RouterRejected as err:  # registering again was refused: the engine must decide
                self._reregister = False
                self.stats.last_error = str(err)
                log.error("registering again after a router restart failed (%s)", err, extra={"worker_id": self.worker_id})
            except RouterUnavailable as err:
                self.stats.reconnects += 1
                self.stats.last_error = str(err)
                log.warning("cannot register again (%s); retrying in %.2fs", err, backoff,
                            extra={"worker_id": self.worker_id})
            except TimeoutError:
                self.stats.reconnects += 1
                self.stats.last_error = "PublishEvents: no acknowledgement in time"
            except Exception as exc:  # never let delivery die; the next stream resends
                self.stats.reconnects += 1
                self.stats.last_error = f"PublishEvents: {exc!r}"
                log.exception("event stream failed", extra={"worker_id": self.worker_id})
            if await self._until_connected():
                continue  # the connection was down and is up again: go on at once
            await asyncio.sleep(backoff)
            failures += 1

    def _rejection(self, err: Exception) -> bool:
        """Whether a failed stream was the router refusing what we sent (resending fails again)
        rather than a broken connection, a worker not registered yet, or a router going away."""
        ambiguous = isinstance(err, RouterRejected) and err.code in _TRANSPORT_OR_ROUTER and self._events_need_router
        before, self._ambiguous_failure = self._ambiguous_failure, err.code if ambiguous else None
        if not isinstance(err, RouterRejected) or err.code is grpc.StatusCode.NOT_FOUND:
            return False
        if ambiguous:  # the same twice in a row, the connection still up: the router's own answer
            return before is err.code and self._connected()
        return True

    def _connected(self) -> bool:
        return self._channel is None or self._channel.get_state() is grpc.ChannelConnectivity.READY

    async def _until_connected(self) -> bool:
        """After a failure with the connection down: wait until gRPC has it up again (it retries
        every CONNECT_BACKOFF_MAX_S at most) rather than sleeping a backoff that may have grown
        while the router was away. True once connected; False at once if the connection is up
        (the router itself ended the stream) or events do not go over it, or after
        ``reconnect_max_s`` without a connection (the caller then tries a stream anyway)."""
        channel = self._channel
        if channel is None or not self._events_need_router:
            return False
        state = channel.get_state(try_to_connect=True)
        if state is grpc.ChannelConnectivity.READY:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reconnect_max_s
        while state is not grpc.ChannelConnectivity.READY:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(channel.wait_for_state_change(state), remaining)
            state = channel.get_state(try_to_connect=True)
        return True

    async def _watch_connection(self) -> None:
        """Read the router's epoch whenever the connection comes back after it broke, so an idle
        publisher resyncs a restarted router as soon as it is reachable (not one probe_interval_s
        later). Asking for the state with try_to_connect also has gRPC reconnect an idle channel.
        Runs only while probing is on (probe_interval_s > 0)."""
        assert self._channel is not None
        was_up = False
        state = self._channel.get_state(try_to_connect=False)
        while True:
            up = state is grpc.ChannelConnectivity.READY
            if up and not was_up and self._router_epoch:
                self._check_epoch = True
                self._wake.set()
            was_up = up
            await self._channel.wait_for_state_change(state)
            state = self._channel.get_state(try_to_connect=self._router_epoch != 0)

    async def _wait_for_work(self, timeout: float | None) -> bool:
        """Wait until there is something to do (True) or ``timeout`` seconds pass idle (False)."""
        while not (self._buffer or self._pending or self._needs_resync or self._check_epoch or self._reregister
                   or self._resync_asked):
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                return False
        return True

    def _probe_after(self) -> float | None:
        """Idle seconds before reading the router's epoch; None when there is nothing to guard
        (no router, probing off, nothing published or registered yet)."""
        if not self._events_need_router or not self.probe_interval_s:
            return None
        if self._written_seq < 0 and self._registration is None:
            return None
        return self.probe_interval_s

    async def _probe(self) -> None:
        """An empty PublishEvents stream: it applies nothing and answers with the router's epoch."""
        assert self._stub is not None
        call = self._stub.PublishEvents()
        self.stats.probes += 1
        try:
            await call.done_writing()
            summary = await asyncio.wait_for(call, self.timeout)
        except BaseException:
            call.cancel()
            raise
        self._check_epoch = False
        self._on_answer(summary)

    async def _register_again(self) -> None:
        assert self._registration is not None
        await self.register(**self._registration)
        self._reregister = False
        self.stats.reregistrations += 1
        log.info("registered again after a router restart", extra={"worker_id": self.worker_id})

    async def _stream(self) -> None:
        """One PublishEvents stream: (re)send what is unacknowledged, add new batches, then close
        it after ack_interval_s (or on flush) and drop what its summary acknowledges."""
        loop = asyncio.get_running_loop()
        assert self._stub is not None  # __init__ requires a router for events over gRPC
        call = self._stub.PublishEvents()
        self.stats.streams += 1
        opened = loop.time()
        last_written = -1
        try:
            while True:
                if self._needs_resync:
                    self._resync()
                self._seal()
                for seq, msg in list(self._buffer):
                    if seq > last_written:
                        # before the write: a write that fails may still have reached the router,
                        # so its number is never reused (a resync reusing it would read as a repeat)
                        self._written_seq = max(self._written_seq, seq)
                        await self._write(call, msg)
                        last_written = seq
                        self.stats.batches_written += 1
                        if seq == 0:
                            break
                # batch 0 is acknowledged on its own: resending an applied 0 would read as an
                # engine restart (the router would clear and rebuild this worker's view)
                if last_written == 0 or (last_written > 0 and (self._flush_now or loop.time() - opened >= self.ack_interval_s)):
                    break
                self._wake.clear()
                remaining = self.ack_interval_s - (loop.time() - opened) if last_written >= 0 else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), remaining)
                if self._pending and self.linger_s:
                    await asyncio.sleep(self.linger_s)
            try:
                await call.done_writing()
            except asyncio.InvalidStateError:
                pass  # the server already ended the call; awaiting it below raises its status
            summary = await asyncio.wait_for(call, max(self.timeout, 1.0) * 10)
        except BaseException:
            call.cancel()
            raise
        acked = 0
        while self._buffer and self._buffer[0][0] <= last_written:
            self._buffer.popleft()
            acked += 1
        self.stats.batches_acked += acked
        self._on_answer(summary)
        self._flush_now = False
        self._acked.set()

    @staticmethod
    async def _write(call: Any, msg: pb.EventBatch) -> None:
        try:
            await call.write(msg)
        except (asyncio.InvalidStateError, grpc.RpcError):
            # a write to a call the server ended fails with a state error or a generic INTERNAL;
            # the call's own status says why (UNAVAILABLE, NOT_FOUND, ...), so raise that one
            await asyncio.wait_for(call, 5.0)
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "stream ended by the server") from None

    async def flush(self, timeout: float | None = None) -> bool:
        """Send everything recorded so far and wait for the router to acknowledge it.
        False if that did not happen within ``timeout`` seconds."""
        if self._task is None:
            raise RuntimeError("the publisher is not started (use `async with` or start())")
        self._seal()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._buffer or self._pending or self._needs_resync:
            self._flush_now = True
            self._acked.clear()
            self._wake.set()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._acked.wait(), remaining)
            except TimeoutError:
                return False
            self._seal()
        return True

    @property
    def unacknowledged_batches(self) -> int:
        return len(self._buffer)

    async def close(self, timeout: float = 5.0) -> None:
        """Flush for up to ``timeout`` seconds, then stop (unsent events are dropped)."""
        if self._task is not None:
            with contextlib.suppress(RuntimeError):
                await self.flush(timeout)
            await _cancelled(self._task)
            self._task = None
        if self._watch is not None:
            await _cancelled(self._watch)
            self._watch = None
        if self._own_channel and self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> EventPublisher:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()
