"""Consume engine KV events from a NATS JetStream stream, so many replicas share one feed.

Topology (docs/deploy.md, "NATS"): engines publish through the SDK (``kvrouter_client``'s
``NatsEventPublisher``) into one JetStream stream, one subject per worker
(``<subject_prefix>.<worker token>``). Every router replica reads the whole stream with its own
ordered consumer, so each engine is read once and every replica applies the same batches in the
same per-worker order, converging on the same index.

A message is one serialized ``kvrouter.v1.EventBatch`` (the ``PublishEvents`` message). Its
decoding is the host's (``decode``: only ``server/convert.py`` knows protobuf types); this module
owns the connection, the consumer and the catch-up point. Sequencing stays the router's: each
batch carries the publisher's per-worker number, so ``Router.apply`` sees a gap (a batch missing
from the stream), a repeat (a publisher retry the stream's de-duplication window did not catch)
or a restart (number 0 again) exactly as it does over gRPC, counts it and degrades the worker
until a ``Cleared`` resyncs it.

Resync requests: a bus publisher cannot read a ``PublishEvents`` answer, so a replica whose view
of a worker lost events asks its publisher directly, on the core NATS subject
``<subject_prefix>-resync.<worker token>`` (outside the stream's subjects), with a
``kvrouter.v1.WorkerSequence``; the SDK's ``NatsEventPublisher`` answers with ``Cleared`` plus its
engine's snapshot on the stream, which heals every replica at once.

Delivery: the ordered consumer is recreated by the client from the last stream sequence it
handed us whenever it sees a hole or the server comes back, so a NATS restart costs neither a
batch nor a double; we check the stream sequence ourselves too and count anything else.

Catch-up: at start the stream's last sequence is read; ``caught_up`` is set once every message
up to it has been applied, which the daemon waits for before reporting SERVING.

A lost stream: NATS may lose the stream (a server restarted without its store) or an operator
may delete it and make it again. A reader tells so by the stream's content (``replaced``) at a
reconnect and every second while connected (``StreamWatch``), then follows the new stream from
its start, counted (``stream_resets``) and logged. A snapshot records the digest of the message
it was taken after, so a replica restoring it tells the same way whether the stream it names is
still there (``snapshot_start``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..errors import BusUnavailable, KVRouterError
from ..protocols import BatchOutcome, EventBatch
from ..tasks import stop_task
from .bus_config import NatsBusConfig

__all__ = [
    "BRIDGE_HEADER", "BusEventSource", "BusStats", "BusUnavailable", "StreamReader", "StreamWatch", "connect",
    "ensure_stream", "message_digest", "replaced", "resume_until_done", "resync_subject", "worker_subject",
]

log = logging.getLogger("kvrouterd.events.nats")

#: header of the messages ``kvrouterd bridge`` publishes for ZMQ engines (events.bridge):
#: their body is the bridge's own encoding, read by the ``bridged`` callback, not ``decode``
BRIDGE_HEADER = "Kvrouter-Bridge"

_TOKEN_SAFE = re.compile(r"[A-Za-z0-9_\-]")

#: a replica this many messages behind the stream logs a warning, and "caught up" once it is
#: not (a slow or paused consumer: the server's flow control holds the rest back meanwhile)
LAG_WARN_MESSAGES = 1000
#: seconds between two checks of the stream's end against what this replica applied
LAG_CHECK_S = 1.0
#: reading the snapshot object: seconds per attempt, and attempts before replaying the stream
SNAPSHOT_READ_TIMEOUT_S = 20.0
SNAPSHOT_READ_ATTEMPTS = 3
#: resuming a stream after a reconnect: seconds before the first retry of a failed attempt,
#: doubled up to the second figure (a restarted server's JetStream may not answer at once)
RESUME_RETRY_S = 0.5
RESUME_RETRY_MAX_S = 10.0


def worker_subject(prefix: str, worker_id: str) -> str:
    """The subject of one worker's events. A worker id may hold '.', '*' or '>', which NATS
    reads as token syntax, so anything outside [A-Za-z0-9_-] is written as %XX (like a URL)."""
    token = "".join(c if _TOKEN_SAFE.match(c) else "".join(f"%{b:02X}" for b in c.encode()) for c in worker_id)
    return f"{prefix}.{token}"


def resync_subject(prefix: str, worker_id: str) -> str:
    """Where replicas ask one worker's publisher for a resync: ``<prefix>-resync.<token>``, which
    the stream's ``<prefix>.>`` never captures (its second-to-last token differs)."""
    return worker_subject(f"{prefix}-resync", worker_id)


@dataclass
class BusStats:
    """Counters of one replica's bus consumer (ListWorkers / metrics show the router's own)."""

    messages: int = 0
    applied: int = 0
    duplicates: int = 0
    gaps: int = 0  # batches the router found missing between two of a worker's batches
    rejected: int = 0  # messages that did not decode or that the router refused
    stream_skips: int = 0  # holes in the stream sequence we were handed (should stay 0)
    last_stream_sequence: int = 0
    reconnects: int = 0
    snapshots_saved: int = 0
    resync_requests: int = 0  # asks sent to publishers whose worker's view lost events
    #: messages in the stream after the last one applied: this replica's lag
    pending: int = 0
    #: times this replica fell LAG_WARN_MESSAGES behind the stream (logged, then "caught up")
    lag_episodes: int = 0
    #: times the stream was found made again (NATS lost it, or it was deleted): at a reconnect, by
    #: the check every LAG_CHECK_S, or at start against the snapshot's; followed anew from its start
    stream_resets: int = 0


async def connect(config: NatsBusConfig, **options: Any) -> Any:
    """A NATS connection, or ``BusUnavailable`` naming the URL when it cannot be made in time."""
    try:
        import nats
    except ImportError:  # pragma: no cover - depends on the installed extras
        raise BusUnavailable("events.bus.kind=nats needs the nats-py package: pip install 'kvrouterd[nats]'") from None
    servers = [u.strip() for u in config.url.split(",")]
    try:
        return await asyncio.wait_for(
            nats.connect(servers, connect_timeout=config.connect_timeout_s, allow_reconnect=True,
                         max_reconnect_attempts=-1, reconnect_time_wait=0.5, **options),
            config.connect_timeout_s * 2,
        )
    except Exception as exc:  # nats raises its own NoServersError, and TimeoutError / OSError
        raise BusUnavailable(f"events.bus: cannot reach NATS at {config.url}: {exc or type(exc).__name__}") from None


async def ensure_stream(js: Any, config: NatsBusConfig) -> Any:
    """The stream's info, creating it (file storage, one subject per worker) when missing."""
    from nats.js.api import StorageType, StreamConfig
    from nats.js.errors import NotFoundError

    try:
        return await js.stream_info(config.stream)
    except NotFoundError:
        await js.add_stream(StreamConfig(
            name=config.stream, subjects=[f"{config.subject_prefix}.>"], storage=StorageType.FILE,
            max_age=config.max_age_s or None, duplicate_window=120.0,
        ))
        return await js.stream_info(config.stream)


async def resume_until_done(resume: Callable[[], Awaitable[None]], stream: str) -> None:
    """Run ``resume`` (a reader's resubscription after a reconnect, or after ``StreamWatch`` found
    its stream gone) until it succeeds, retrying after RESUME_RETRY_S, then twice as long each
    time up to RESUME_RETRY_MAX_S. A reader that gave up after one failed attempt stayed SERVING
    without a consumer for good, its view of the fleet frozen; the next reconnect starts a new
    attempt, cancelling this one."""
    delay = RESUME_RETRY_S
    while True:
        try:
            await resume()
            return
        except Exception as exc:  # JetStream not ready yet after a server restart, or the connection dropped again
            log.warning("could not resume following the stream %s (trying again in %.1fs): %s",
                        stream, delay, exc or type(exc).__name__)
        await asyncio.sleep(delay)
        delay = min(delay * 2, RESUME_RETRY_MAX_S)


def message_digest(data: bytes) -> str:
    """What a snapshot records of the message it was taken after (``replaced``'s
    ``applied_digest``): enough to tell another message at that sequence, in a fixed size where
    the message may be up to the server's max_payload."""
    return hashlib.sha256(data).hexdigest()


async def replaced(
    js: Any, stream: str, info: Any, applied: int, applied_data: bytes | None, applied_digest: str = ""
) -> bool:
    """Whether the stream ``info`` describes is not the one a reader followed up to sequence
    ``applied`` (whose message held ``applied_data``, or data whose ``message_digest`` is
    ``applied_digest``: what a snapshot records): NATS lost that one (a server restarted
    without its store, the stream was deleted) and it was created again, its sequences
    beginning at 1. Read with the reader's consumer stopped, so ``applied`` does not move, or
    with ``applied`` read before ``info`` (``StreamWatch``).

    Told by content, not by the stream's creation time, which some nats-server releases change
    on a restart that kept the stream (nats-server#8470): a stream ending before ``applied`` is
    a new one; otherwise its message at ``applied`` is fetched and compared. A message aged out
    or deleted there cannot be compared, and the stream counts as the same one (its holes are
    the consumer's ``stream_skips``)."""
    from nats.js.errors import NotFoundError

    if applied <= 0:
        return False
    if info.state.last_seq < applied:
        return True
    if (applied_data is None and not applied_digest) or applied < info.state.first_seq:
        return False
    try:
        stored = await js.get_msg(stream, applied)
    except NotFoundError:
        return False
    if applied_data is not None:
        return (stored.data or b"") != applied_data
    return message_digest(stored.data or b"") != applied_digest


class StreamWatch:
    """Whether the stream a reader follows, while its connection stays up, is still the one it
    applied from. An operator may delete the stream and make it again, or NATS may lose it,
    without the connection dropping: the reader's consumer is then gone with it, and only a
    reconnect checked the stream (``replaced``). Meanwhile the replica answered SERVING on a
    view nobody fed, until nats-py's ordered consumer, after two missed heartbeats (10 s or
    more), re-created itself on the new stream after the old one's last sequence, skipping
    every message of the new one below it.

    Checked with the consumer running, which is safe here: what was applied is read before the
    stream is, and a stream never moves its end back nor changes a message it holds, so what
    the consumer applies meanwhile cannot make the same stream look new. The stream is compared
    with what was applied at the previous check, not the latest: a consumer that re-created
    itself on a new stream in between applied that stream's messages, which would match it."""

    def __init__(self, js: Any, stream: str, applied: Callable[[], tuple[int, bytes | None]],
                 resets: Callable[[], int]) -> None:
        self._js = js
        self._stream = stream
        self._applied = applied
        self._resets = resets
        #: what was applied at the last check, and the reader's stream resets counted then
        self._witness = (*applied(), resets())

    async def check(self) -> tuple[bool, Any | None]:
        """``(lost, info)``: whether the stream is gone (``info`` None: deleted, not made again
        yet) or is a new one (``info``, its state). Raises what NATS raises otherwise (away)."""
        from nats.js.errors import NotFoundError

        sequence, data, resets = self._witness
        latest = (*self._applied(), self._resets())
        try:
            info = await self._js.stream_info(self._stream)
        except NotFoundError:
            return True, None
        lost = await replaced(self._js, self._stream, info, sequence, data)
        if self._resets() != resets:
            # the reader followed a new stream since the witness was read (a reconnect found it):
            # the witness was the old stream's, and the new one differs from it by design
            self._witness = (*self._applied(), self._resets())
            return False, info
        self._witness = latest
        return lost, info


class StreamReader(ABC):
    """What the two readers of a stream (engine events: ``BusEventSource``; load deltas:
    ``replica_sync.ReplicaSync``) share to stop their consumer and to follow a stream that
    ``StreamWatch`` found gone or made again. A reader has ``config.stream``, its consumer in
    ``_sub``, ``_resubscribe`` (check the stream with the consumer stopped, then follow it) and
    ``_stream_lost`` (count and log a new stream, forget what the old one applied)."""

    #: the stream's name in the log and in its tasks' names: "event" or "load"
    STREAM_KIND = ""
    config: Any
    stats: Any  # its last_stream_sequence and stream_resets
    _js: Any
    _sub: Any
    #: the data of the message at ``stats.last_stream_sequence`` (``replaced``)
    _applied_data: bytes | None
    #: whether ``start`` ran (``close`` clears it first: no resume starts after)
    _following: bool
    #: the resume under way (after a reconnect, or a stream found lost), if any
    _resume: asyncio.Task[None] | None

    @abstractmethod
    async def _resubscribe(self) -> None: ...

    @abstractmethod
    def _stream_lost(self, info: Any) -> None: ...

    def _stream_watch(self) -> StreamWatch:
        return StreamWatch(self._js, self.config.stream, lambda: (self.stats.last_stream_sequence, self._applied_data),
                           lambda: self.stats.stream_resets)

    def _resume_after_reconnect(self) -> None:
        """A reconnect: the consumer (and the stream with it) may be gone; resume following,
        restarting an attempt still under way."""
        if self._following:
            if self._resume is not None:
                self._resume.cancel()
            self._resume = asyncio.create_task(resume_until_done(self._resubscribe, self.config.stream),
                                               name=f"kvrouterd-{self.STREAM_KIND}-resume")

    def _follow_anew(self, info: Any | None) -> None:
        """``StreamWatch`` found the stream gone or made again: follow it anew, unless a resume
        is under way (it checks the stream itself)."""
        if self._resume is None or self._resume.done():
            self._resume = asyncio.create_task(self._resume_after_loss(info),
                                               name=f"kvrouterd-{self.STREAM_KIND}-resume")

    async def _stop_consumer(self) -> None:
        old, self._sub = self._sub, None
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()

    async def _resume_after_loss(self, info: Any | None) -> None:
        """``StreamWatch`` found the stream gone (``info`` None) or made again: follow it anew."""
        if info is None:
            # made again here with the replicas' settings, as after a reconnect (the replicas own
            # them; an engine's publisher only retries); then checked with the consumer stopped:
            # a stream that reappears with its messages (a server answering before it loaded its
            # store) is followed on, an empty one from its start
            log.warning("the %s stream is gone (deleted?); making it again and following it", self.STREAM_KIND,
                        extra={"stream": self.config.stream})
        else:
            # the watch's proof holds whatever the consumer applies: stop it before forgetting
            # what it applied, or one of its messages still under way would count as the new
            # stream's and hide that stream's messages up to its sequence
            await self._stop_consumer()
            self._stream_lost(info)
        await resume_until_done(self._resubscribe, self.config.stream)


class BusEventSource(StreamReader):
    """One replica's reader of the shared event stream.

    ``decode(bytes) -> EventBatch`` and ``apply(EventBatch) -> BatchOutcome`` are the host's
    (the daemon passes ``convert`` and ``KVRouterService.apply_batch``); ``bridged(bytes)``
    takes the messages ``kvrouterd bridge`` publishes for ZMQ engines (``events.bridge``)."""

    STREAM_KIND = "event"

    def __init__(
        self,
        config: NatsBusConfig,
        decode: Callable[[bytes], EventBatch],
        apply: Callable[[EventBatch], BatchOutcome],
        bridged: Callable[[bytes], BatchOutcome] | None = None,
    ) -> None:
        self.config = config
        self._decode = decode
        self._apply = apply
        self._bridged = bridged
        self.stats = BusStats()
        #: set once every message in the stream at start has been applied
        self.caught_up = asyncio.Event()
        self._target = 0
        self._nc: Any = None
        self._js: Any = None
        self._sub: Any = None
        self._resume: asyncio.Task[None] | None = None
        #: the data of the message at ``stats.last_stream_sequence`` (``replaced``), and whether
        #: ``start`` ran (``close`` clears it first: no resume starts after)
        self._applied_data: bytes | None = None
        self._following = False
        #: the sequence and digest of the snapshot this reader started after (``snapshot_start``)
        self._restored: tuple[int, str] = (0, "")
        self._seen_end = 0
        self._behind_since: float | None = None
        self._caught_up_at = 0
        self._lag_watch: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        """Connect and make sure the stream exists. Raises ``BusUnavailable``."""

        async def reconnected() -> None:
            self.stats.reconnects += 1
            log.warning("reconnected to NATS", extra={"url": self.config.url})
            self._resume_after_reconnect()

        self._nc = await connect(self.config, reconnected_cb=reconnected)
        self._js = self._nc.jetstream()
        try:
            info = await ensure_stream(self._js, self.config)
        except Exception as exc:
            await self.close()
            raise BusUnavailable(f"events.bus: JetStream stream {self.config.stream!r} unavailable: {exc}") from None
        self._target = info.state.last_seq

    @property
    def stream_end(self) -> int:
        """The stream's last sequence when we connected."""
        return self._target

    def applied_digest(self) -> str:
        """The ``message_digest`` of the message at ``stats.last_stream_sequence`` ("" when none
        was applied), which a snapshot taken now records beside that sequence."""
        if self._applied_data is not None:
            return message_digest(self._applied_data)
        # nothing applied since the snapshot this reader started after: its digest still holds,
        # and a snapshot written now without it could be told from a new stream by its end alone
        sequence, digest = self._restored
        return digest if self.stats.last_stream_sequence == sequence else ""

    async def snapshot_start(self, sequence: int, digest: str) -> int:
        """Where to follow the stream after restoring a snapshot taken after stream sequence
        ``sequence``, whose message's ``message_digest`` was ``digest`` ("" in a snapshot written
        before digests were recorded: then only a stream ending before ``sequence`` tells): that
        sequence, or 0 if the stream was made again since, counted and logged as a live reset
        is. Called after ``connect`` and before ``start``: no consumer runs, nothing moves."""
        info = await ensure_stream(self._js, self.config)
        if not await replaced(self._js, self.config.stream, info, sequence, None, digest):
            self._restored = (sequence, digest)
            return sequence
        self.stats.stream_resets += 1
        log.warning("the event stream was created again since the bus snapshot was written (NATS lost it, or it was "
                    "deleted); following the new one from its start, after stream sequence %d of the old one, with "
                    "the snapshot's index; workers whose batches were lost resync through their gaps", sequence,
                    extra={"stream": self.config.stream})
        self._target = info.state.last_seq
        return 0

    async def start(self, start_after: int = 0) -> None:
        """Follow the stream from stream sequence ``start_after + 1`` (0: from its first
        message); ``caught_up`` is set once the stream's end at connect time is applied."""
        if self._js is None:
            await self.connect()
        self.stats.last_stream_sequence = start_after
        if self._target <= start_after:
            self.caught_up.set()
        await self._subscribe(start_after)
        self._following = True
        self._lag_watch = asyncio.create_task(self._watch_lag(), name="kvrouterd-bus-lag")
        log.info("following the event bus", extra={"stream": self.config.stream, "from": start_after + 1,
                                                   "backlog": max(0, self._target - start_after)})

    async def _subscribe(self, after: int) -> None:
        from nats.js.api import ConsumerConfig, DeliverPolicy

        subject = f"{self.config.subject_prefix}.>"
        if after > 0:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1)
        else:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        self._sub = await self._js.subscribe(subject, cb=self._on_message, ordered_consumer=True, config=config)

    async def _resubscribe(self) -> None:
        """After a reconnect: the server may have restarted and lost our ephemeral consumer,
        which the client would only notice after missed heartbeats (seconds). Start a new one
        right after the last sequence applied; anything the old one still delivers is older
        and skipped by ``_on_message``. A server that restarted without its store lost the
        stream too: it is created again and followed from its start (``_stream_lost``). The old
        consumer stops first, so what was applied holds still while the stream is checked."""
        await self._stop_consumer()
        info = await ensure_stream(self._js, self.config)
        if await replaced(self._js, self.config.stream, info, self.stats.last_stream_sequence, self._applied_data):
            self._stream_lost(info)
        await self._subscribe(self.stats.last_stream_sequence)

    def _stream_lost(self, info: Any) -> None:
        """The stream is a new one: what the old one held is gone, and its sequences begin at 1.
        A batch published to neither reaches no replica; the router sees it as a gap in its
        worker's numbers when the next batch comes and asks that publisher to resync. The index
        keeps what it holds: those gaps say which workers' views are stale."""
        self.stats.stream_resets += 1
        log.warning("the event stream was created again (NATS lost it, or it was deleted); "
                    "following the new one from its start, after stream sequence %d of the old one; workers "
                    "whose batches were lost resync through their gaps", self.stats.last_stream_sequence,
                    extra={"stream": self.config.stream})
        self.stats.last_stream_sequence = 0
        self._applied_data = None
        self._seen_end = self._caught_up_at = 0
        # a replica still catching up at start waited for the old stream's end: now the new one's
        self._target = info.state.last_seq
        if self._target == 0:
            self.caught_up.set()

    async def _object_store(self) -> Any:
        from nats.js.errors import BucketNotFoundError

        try:
            return await self._js.object_store(self.config.snapshot_bucket)
        except BucketNotFoundError:
            return await self._js.create_object_store(self.config.snapshot_bucket)

    async def load_snapshot(self) -> bytes | None:
        """The latest index snapshot written for this stream, or None if there is none yet."""
        from nats.js.errors import ObjectNotFoundError

        store = await self._object_store()
        for _ in range(SNAPSHOT_READ_ATTEMPTS):
            try:
                # nats-py reads the chunks with no deadline: a snapshot another replica replaces
                # meanwhile (its old chunks purged) would stall start-up for good
                result = await asyncio.wait_for(store.get(self.config.stream), SNAPSHOT_READ_TIMEOUT_S)
            except ObjectNotFoundError:
                return None
            except TimeoutError:
                log.warning("reading the bus snapshot took over %ss (replaced while read?); trying again",
                            SNAPSHOT_READ_TIMEOUT_S, extra={"bucket": self.config.snapshot_bucket})
                continue
            return bytes(result.data)
        log.warning("no readable bus snapshot; replaying the whole stream", extra={"bucket": self.config.snapshot_bucket})
        return None

    async def save_snapshot(self, data: bytes) -> None:
        """Replace the snapshot of this stream (any replica may write it: each is a consistent
        image of the same stream at the sequence it names)."""
        store = await self._object_store()
        await store.put(self.config.stream, data)
        self.stats.snapshots_saved += 1

    async def request_resync(self, worker_id: str, request: bytes) -> None:
        """Ask the worker's publisher to resync (``request``: a serialized WorkerSequence). Core
        NATS, fire and forget: the host asks again while the view stays incomplete."""
        if self._nc is None:
            return
        await self._nc.publish(resync_subject(self.config.subject_prefix, worker_id), request)
        self.stats.resync_requests += 1

    async def _on_message(self, msg: Any) -> None:
        seq = msg.metadata.sequence.stream
        last = self.stats.last_stream_sequence
        if seq <= last:
            return  # redelivered after the consumer was recreated; already applied
        if seq != last + 1 and last > 0:
            # the stream itself lost messages (age / size limits): the router's per-worker
            # sequence shows which workers they belonged to, this counts that it happened
            self.stats.stream_skips += 1
            log.warning("event stream skipped %d message(s)", seq - last - 1, extra={"stream": self.config.stream})
        self.stats.last_stream_sequence = seq
        self._applied_data = msg.data
        self.stats.messages += 1
        try:
            if self._bridged is not None and msg.headers and BRIDGE_HEADER in msg.headers:
                outcome = self._bridged(msg.data)
            else:
                outcome = self._apply(self._decode(msg.data))
        except KVRouterError as exc:
            self.stats.rejected += 1
            log.warning("event batch from the bus rejected: %s", exc, extra={"subject": msg.subject})
        else:
            if outcome.duplicate:
                self.stats.duplicates += 1
            else:
                self.stats.applied += 1
            if outcome.gap:
                self.stats.gaps += 1
        if seq >= self._target:
            self.caught_up.set()
        # what the server had not delivered yet when it sent this one (the stream's end then),
        # and what it has delivered that waits in this client behind this one: after a loop or
        # process that stood still, the whole backlog is here, and the server says 0 for each
        waiting = self._sub.pending_msgs if self._sub is not None else 0
        self._seen_end = max(self._seen_end, seq + msg.metadata.num_pending, seq + waiting)
        self._note_lag(self._seen_end - seq)

    async def _watch_lag(self) -> None:
        """Every LAG_CHECK_S, check that the stream is still the one followed (``StreamWatch``)
        and compare its end with what was applied. The messages alone cannot show a lag: those
        the server pushed ahead sit in the client's buffer while the replica is slow or paused,
        and each says nothing was pending when sent."""
        watch = self._stream_watch()
        while True:
            await asyncio.sleep(LAG_CHECK_S)
            asked_at = self.stats.last_stream_sequence
            try:
                lost, info = await watch.check()
            except Exception:  # NATS away: the reconnect logic reports that; check again later
                continue
            if lost or info is None:  # (None: gone, so lost)
                self._follow_anew(info)
                continue
            end = info.state.last_seq
            self._seen_end = max(self._seen_end, end)
            if asked_at >= self._caught_up_at:  # (a catch-up logged meanwhile answered it already)
                self._note_lag(max(0, end - asked_at))  # how far behind it was when we asked...
            self._note_lag(max(0, self._seen_end - self.stats.last_stream_sequence), confirmed=True)  # ...and is now

    def _note_lag(self, lag: int, confirmed: bool = False) -> None:
        """Record the lag; warn when it reaches LAG_WARN_MESSAGES. Only the server's word
        (``confirmed``: the stream's end just read) ends a lag episode: the messages' own
        counts miss what flow control still holds back on the server."""
        self.stats.pending = lag
        now = asyncio.get_running_loop().time()
        if lag >= LAG_WARN_MESSAGES and self._behind_since is None:
            self._behind_since = now
            self.stats.lag_episodes += 1
            log.warning("replica is %d messages behind the event stream", lag, extra={"stream": self.config.stream})
        elif lag == 0 and confirmed and self._behind_since is not None:
            log.info("caught up with the event stream after %.1fs behind", now - self._behind_since,
                     extra={"stream": self.config.stream})
            self._behind_since = None
            self._caught_up_at = self.stats.last_stream_sequence

    async def close(self) -> None:
        self._following = False
        await stop_task(self._lag_watch)
        await stop_task(self._resume)
        if self._nc is not None:
            await self._nc.close()
            self._nc = None
            self._js = None
