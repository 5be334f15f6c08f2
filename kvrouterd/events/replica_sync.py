"""Replica sync on the event bus: every router replica sees the fleet's in-flight load and the
same approximate-mode cache models (``events.bus.replica_sync``, docs/deploy.md "NATS").

Each replica publishes a small load delta for every routing decision it commits (request id,
worker, prefill tokens charged; for an approximate-mode worker also the routed prompt's block
keys and the blocks its eviction dropped; a disaggregated decision's prefill hop as a delta of
its own, under the hop's id) and for every ``Complete`` it receives (a ``prefill_done`` one
releases the prefill hop alone), into one JetStream stream. Every replica reads the whole stream in order and applies the other replicas'
deltas to its router (``Router.apply_dispatch`` / ``apply_completion``): load is charged and
released by request id, so a ``Complete`` may reach any replica. This follows NVIDIA Dynamo's
router replica sync (each KV router publishes its active-sequence add/free events tagged with its
router id, and skips its own); unlike Dynamo's core-NATS subjects, the deltas sit in a stream
that keeps ``inflight_timeout_s`` of history, so a restarted or new replica replays that window
and starts with the fleet's in-flight requests instead of none.

Ordering and loss:

* A replica's own deltas come back in stream order. Load is not charged twice (it was charged
  when routed), but approximate prefixes are re-applied, so all replicas end on the stream's
  order of stores and evictions whatever order each saw them in locally.
* A ``Complete`` sent to replica B can overtake the routing replica A's Dispatch (the gateway is
  faster than the bus). B publishes the completion anyway and remembers the id; every replica
  that reads the completion first remembers it too, and the late Dispatch charges nothing.
* A lost ``Complete`` (caller crashed) is released by every replica after ``inflight_timeout_s``
  from when it was routed (the stream's timestamp), as on a single replica.
* Deltas published while NATS is unreachable wait in the client's reconnect buffer; those that do
  not fit are counted (``publish_errors``) and logged: the requests they describe then expire.
* A load stream NATS lost, or that was deleted (and made again), is noticed at a reconnect or by
  the check every STREAM_CHECK_S (``nats_bus.StreamWatch``), counted (``stream_resets``) and
  followed anew from its start; the deltas published meanwhile are gone and their requests expire.

The host owns the wire format (``decode``/``marker``: only ``server/convert.py`` touches protobuf)
and the router calls (``apply``); this module owns the connection, the stream and ordering.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import BusUnavailable, KVRouterError
from ..tasks import stop_task
from .bus_config import NatsBusConfig, ReplicaSyncConfig
from .nats_bus import StreamReader, connect, replaced

__all__ = ["ReplicaSync", "SyncStats"]

log = logging.getLogger("kvrouterd.events.replica_sync")

#: extra history the load stream keeps beyond the in-flight timeout (slow starts, clock skew)
HISTORY_MARGIN_S = 60.0
#: seconds between two checks that the load stream is still the one followed (``StreamWatch``):
#: until one, a replica whose stream was deleted and made again applies nobody's deltas
STREAM_CHECK_S = 1.0


@dataclass
class SyncStats:
    """Counters of one replica's load sync (what the router did with them is in its counters)."""

    published: int = 0
    #: deltas that could not be handed to NATS (reconnect buffer full, connection closed)
    publish_errors: int = 0
    received: int = 0
    #: this replica's own deltas read back
    own: int = 0
    #: deltas that did not decode or that the router refused
    rejected: int = 0
    #: holes in the stream sequence we were handed (history expired under a slow reader)
    stream_skips: int = 0
    last_stream_sequence: int = 0
    reconnects: int = 0
    #: messages replayed from the stream's history at start
    replayed: int = 0
    #: times the stream was found made again (NATS lost it, or it was deleted), at a reconnect
    #: or by the check every STREAM_CHECK_S: followed anew from its start
    stream_resets: int = 0


class ReplicaSync(StreamReader):
    """One replica's publisher and reader of the shared load stream.

    ``decode(data, age_s) -> (replica_id, delta)`` reads one message (``delta`` None for a
    catch-up marker); ``apply(delta, own)`` applies it to the router; ``marker(replica_id)``
    encodes a marker. ``window_s`` is the router's in-flight timeout: how much history a
    starting replica replays."""

    STREAM_KIND = "load"

    def __init__(
        self,
        bus: NatsBusConfig,
        window_s: float,
        decode: Callable[[bytes, float], tuple[str, object | None]],
        apply: Callable[[object, bool], None],
        marker: Callable[[str], bytes],
        replica_id: str = "",
    ) -> None:
        self.bus = bus
        self.config: ReplicaSyncConfig = bus.replica_sync
        self.window_s = window_s
        self._decode = decode
        self._apply = apply
        self._marker = marker
        #: random per process: a restarted replica's old deltas read as another replica's,
        #: which is right (its in-flight requests may still complete anywhere)
        self.replica_id = replica_id or uuid.uuid4().hex[:16]
        self.stats = SyncStats()
        #: set once this replica's start marker came back: every older delta is applied
        self.caught_up = asyncio.Event()
        self._nc: Any = None
        self._js: Any = None
        self._sub: Any = None
        self._outbox: collections.deque[Callable[[str], bytes]] = collections.deque()
        self._wake = asyncio.Event()
        self._publisher: asyncio.Task[None] | None = None
        self._resume: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        #: the data of the message at ``stats.last_stream_sequence`` (``nats_bus.replaced``), and
        #: whether ``start`` ran (``close`` clears it first: no resume starts after)
        self._applied_data: bytes | None = None
        self._following = False

    # ---- start -------------------------------------------------------------------------
    async def connect(self) -> None:
        """Connect and make sure the load stream exists. Raises ``BusUnavailable``."""

        async def reconnected() -> None:
            self.stats.reconnects += 1
            self._resume_after_reconnect()

        self._nc = await connect(self.bus, reconnected_cb=reconnected)
        self._js = self._nc.jetstream()
        try:
            await self._ensure_stream()
        except Exception as exc:
            await self.close()
            raise BusUnavailable(f"events.bus.replica_sync: JetStream stream {self.config.stream!r} unavailable: {exc}") from None

    async def _ensure_stream(self) -> Any:
        """The load stream's info, creating it when missing."""
        from nats.js.api import StorageType, StreamConfig
        from nats.js.errors import NotFoundError

        try:
            return await self._js.stream_info(self.config.stream)
        except NotFoundError:
            await self._js.add_stream(StreamConfig(
                name=self.config.stream, subjects=[self.config.subject], storage=StorageType.FILE,
                max_age=self.window_s + HISTORY_MARGIN_S,
            ))
            return await self._js.stream_info(self.config.stream)

    async def start(self) -> None:
        """Replay the last ``window_s`` of deltas, then follow the stream; ``caught_up`` is set
        once this replica's start marker is read back (everything published before it is applied)."""
        from nats.js.api import ConsumerConfig, DeliverPolicy

        if self._js is None:
            await self.connect()
        since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=self.window_s)
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
        self._sub = await self._js.subscribe(self.config.subject, cb=self._on_message, ordered_consumer=True,
                                             config=config)
        self._following = True
        self._publisher = asyncio.create_task(self._publish_loop(), name="kvrouterd-sync-publish")
        self._watch = asyncio.create_task(self._watch_stream(), name="kvrouterd-sync-watch")
        self.publish(self._marker)
        log.info("sharing in-flight load over the event bus",
                 extra={"stream": self.config.stream, "replica_id": self.replica_id, "replay_s": self.window_s})

    async def _resubscribe(self) -> None:
        """After a reconnect: resume right after the last sequence applied (a restarted server
        may have dropped our consumer; see ``BusEventSource._resubscribe``). A stream NATS lost
        (a server restarted without its store) is created again and followed from its start:
        deltas published to neither are gone, and their requests expire after the in-flight
        timeout, as a lost Complete's do."""
        from nats.js.api import ConsumerConfig, DeliverPolicy

        await self._stop_consumer()  # stopped first: what was applied holds still while checked
        info = await self._ensure_stream()
        if await replaced(self._js, self.config.stream, info, self.stats.last_stream_sequence, self._applied_data):
            self._stream_lost(info)
        last = self.stats.last_stream_sequence
        config = (ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=last + 1) if last
                  else ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        self._sub = await self._js.subscribe(self.config.subject, cb=self._on_message, ordered_consumer=True,
                                             config=config)

    async def _watch_stream(self) -> None:
        """Every STREAM_CHECK_S, check that the load stream is still the one followed; one
        deleted (and made again) while connected is followed anew, as at a reconnect (see
        ``BusEventSource._watch_lag``, which does the same beside its lag check)."""
        watch = self._stream_watch()
        while True:
            await asyncio.sleep(STREAM_CHECK_S)
            try:
                lost, info = await watch.check()
            except Exception:  # NATS away: the reconnect resumes the stream; check again later
                continue
            if lost:
                self._follow_anew(info)

    def _stream_lost(self, info: Any) -> None:
        """The stream is a new one, its sequences beginning at 1: follow it from its start. A
        replica still replaying at start waits for its marker, which went with the old stream:
        it sends another."""
        self.stats.stream_resets += 1
        log.warning("the load stream was created again (NATS lost it, or it was deleted); "
                    "following the new one from its start, after stream sequence %d of the old one",
                    self.stats.last_stream_sequence, extra={"stream": self.config.stream})
        self.stats.last_stream_sequence = 0
        self._applied_data = None
        if not self.caught_up.is_set():
            self.publish(self._marker)

    # ---- publishing --------------------------------------------------------------------
    def publish(self, encode: Callable[[str], bytes]) -> None:
        """Queue one delta; ``encode(replica_id)`` runs later in the publisher task, so the
        Route that committed it pays only for the append."""
        self._outbox.append(encode)
        self._wake.set()

    async def _publish_loop(self) -> None:
        outbox, subject = self._outbox, self.config.subject
        while True:
            await self._wake.wait()
            self._wake.clear()
            while outbox:
                encode = outbox.popleft()
                try:
                    await self._nc.publish(subject, encode(self.replica_id))
                except Exception as exc:  # buffer full during an outage, or closed: the delta is lost
                    self.stats.publish_errors += 1
                    if self.stats.publish_errors & (self.stats.publish_errors - 1) == 0:  # 1, 2, 4, ...
                        log.warning("load delta not published (%d so far): %s; its request expires after "
                                    "inflight_timeout_s on the other replicas", self.stats.publish_errors, exc)
                else:
                    self.stats.published += 1

    async def flush(self, timeout: float = 5.0) -> None:
        """Until every queued delta is handed to the server (tests and shutdown)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._outbox and loop.time() < deadline:
            await asyncio.sleep(0.005)
        if self._nc is not None and self._nc.is_connected:
            with contextlib.suppress(Exception):
                await self._nc.flush(max(0.1, deadline - loop.time()))

    # ---- reading -----------------------------------------------------------------------
    async def _on_message(self, msg: Any) -> None:
        meta = msg.metadata
        seq = meta.sequence.stream
        last = self.stats.last_stream_sequence
        if seq <= last:
            return  # redelivered after the consumer was recreated; already applied
        if last and seq != last + 1:
            self.stats.stream_skips += 1
            log.warning("load stream skipped %d message(s)", seq - last - 1, extra={"stream": self.config.stream})
        self.stats.last_stream_sequence = seq
        self._applied_data = msg.data
        self.stats.received += 1
        if not self.caught_up.is_set():
            self.stats.replayed += 1
        age = max(0.0, time.time() - meta.timestamp.timestamp())
        try:
            replica, delta = self._decode(msg.data, age)
            own = replica == self.replica_id
            if own:
                self.stats.own += 1
            if delta is None:
                if own:
                    self.caught_up.set()
                return
            self._apply(delta, own)
        except KVRouterError as exc:
            self.stats.rejected += 1
            log.warning("load delta from the bus rejected: %s", exc)

    async def close(self) -> None:
        self._following = False
        for task in (self._watch, self._publisher, self._resume):
            await stop_task(task)
        self._watch = self._publisher = self._resume = None
        if self._nc is not None:
            await self._nc.close()
            self._nc = None
            self._js = None
