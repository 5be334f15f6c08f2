"""Bridge vLLM / SGLang ZMQ KV events onto the NATS event bus: each engine is read once.

Topology (docs/deploy.md, "ZMQ engines on the bus"): one ``kvrouterd bridge`` process
subscribes to every engine's ZMQ publisher with the daemon's own ``ZmqEventSource`` (its
sequencing, gap replay and restart detection, unchanged) and, instead of applying what that
source hands over, publishes it into the JetStream stream. Every replica follows the stream
(``nats_bus.BusEventSource``) and replays the three calls the source makes, in the same
order, on its own router:

* ``apply(batch)``: the decoded batch (sequence numbered 0, 1, ... by the source after each
  reset, a ``Cleared`` first when the source rebuilds the view);
* ``reset(worker, lost)``: the source replayed or joined the engine (``lost=False``) or lost
  events beyond replay (``lost=True``: the worker is cleared and DEGRADED on every replica);
* ``rejected(worker, counts, lost_removal)``: events the adapter could not decode (a lost
  removal degrades the worker until the source's resync).

So a replica ends exactly where a daemon subscribing to the engine itself would, and a gap
the bridge could not replay reaches every replica as DEGRADED instead of vanishing.

Wire: JetStream messages on the worker's subject, with the header ``Kvrouter-Bridge: 1`` and
a msgpack body: the list of that worker's calls queued since the last message, in call order
(``encode_*`` / ``message`` / ``decode_bridged``), within the server's ``max_payload`` and, past
its first call, ``max_message_blocks``: a replica applies a message in one turn of its loop, so a
huge engine batch travels as the parts the source cut it into (``events.parts``). Not the
protobuf ``EventBatch``: engine events carry fields it does not (hybrid KV groups, vLLM's
multimodal extra keys), and the resets and rejection counts have no protobuf form. Message ids
(``Nats-Msg-Id``: ``bridge.<run>.<n>``) let the stream drop a publish retried after a NATS
outage.

Only one bridge may publish for an engine: two would each number the worker's batches from
0 and interleave them. Run it as a single-replica Deployment (``strategy: Recreate``; the Helm
chart's ``bridge.enabled``). A bridge that restarts joins each engine again (reset, replay
from 0 with ``Cleared``), so replicas rebuild the worker's view rather than trust it.

Back-pressure: publishes wait for JetStream's acknowledgement, one message at a time, so the
stream holds each worker's calls in the order they were made; while one is in flight the next
calls queue and go out together in the next message, so the rate is not one call per round trip. Calls made while NATS is slow or away queue up
to ``max_pending``; past that a worker's batches are dropped, replicas are told the worker
lost events (``reset lost``: cleared, DEGRADED), and once the queue has drained to half the
worker's subscriber is started again, which rejoins the engine by replay and makes it READY.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import tenacity

from ..errors import BusUnavailable, InvalidRequest, KVRouterError
from ..protocols import BatchOutcome, CacheEvent, Cleared, EventBatch, Removed, Stored
from ..retry import Backoff
from ..tasks import stop_task
from .bus_config import NatsBusConfig
from .nats_bus import BRIDGE_HEADER, connect, ensure_stream, worker_subject
from .parts import DEFAULT_BLOCK_SIZE, MAX_PART_BLOCKS, batch_blocks
from .zmq_config import ZmqEventsConfig
from .zmq_source import ZmqEventSource, _WorkerLike

__all__ = [
    "BRIDGE_HEADER",
    "BridgeStats",
    "BridgedEvents",
    "BusBridge",
    "decode_bridged",
    "encode_batch",
    "encode_rejected",
    "encode_reset",
    "message",
]

log = logging.getLogger("kvrouterd.events.bridge")

#: the value of ``BRIDGE_HEADER``: the version of the body layout below (for a future change)
WIRE_VERSION = "1"
_OP_EVENTS, _OP_RESET, _OP_REJECTED = 0, 1, 2
_STORED, _REMOVED, _CLEARED = 0, 1, 2
_ARRAY_HEADER = msgpack.Packer()
_U64 = (1 << 64) - 1

#: calls queued for NATS before a worker's batches are dropped (and it is resynced)
DEFAULT_MAX_PENDING = 100_000
#: most calls taken from the queue for one round of messages (one per worker)
MAX_CALLS_PER_ROUND = 4096
#: waits between tries of one publish (``retry``): short, since the queue grows meanwhile
BRIDGE_PUBLISH_BACKOFF = Backoff(0.05, 2.0)


# ---- wire ------------------------------------------------------------------------------------
def _event(ev: CacheEvent) -> list[Any]:
    if isinstance(ev, Stored):
        tokens = ev.token_ids if isinstance(ev.token_ids, bytes) else _u32_bytes(ev.token_ids)
        return [_STORED, tokens, None if ev.engine_hashes is None else list(ev.engine_hashes), ev.parent_engine_hash,
                ev.block_size, ev.model, ev.lora, ev.group, ev.group_kind, ev.salt,
                None if ev.extra_hashes is None else list(ev.extra_hashes)]
    if isinstance(ev, Removed):
        return [_REMOVED, list(ev.engine_hashes), ev.group]
    return [_CLEARED]


def _u32_bytes(tokens: Iterable[int]) -> bytes:
    from array import array

    out = array("I", tokens)
    if out.itemsize != 4:  # pragma: no cover - every platform we build for has 4-byte unsigned int
        raise InvalidRequest("this platform's array('I') is not 32-bit")
    return out.tobytes()


def encode_batch(batch: EventBatch) -> bytes:
    """A batch the ZMQ source handed over, as the bridge publishes it."""
    return msgpack.packb([_OP_EVENTS, batch.worker_id, batch.sequence, [_event(ev) for ev in batch.events]])


def encode_reset(worker_id: str, lost: bool) -> bytes:
    return msgpack.packb([_OP_RESET, worker_id, bool(lost)])


def encode_rejected(worker_id: str, counts: Mapping[str, int], lost_removal: bool) -> bytes:
    return msgpack.packb([_OP_REJECTED, worker_id, dict(counts), bool(lost_removal)])


@dataclass(frozen=True)
class Reset:
    worker_id: str
    lost: bool


@dataclass(frozen=True)
class Rejected:
    worker_id: str
    counts: dict[str, int]
    lost_removal: bool


def _int(value: Any, what: str, hi: int = _U64) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise InvalidRequest(f"bridged message: {what} must be an integer in [0, {hi}], got {value!r}")
    return value


def _opt_int(value: Any, what: str) -> int | None:
    return None if value is None else _int(value, what)


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"bridged message: {what} must be a string, got {type(value).__name__}")
    return value


def _hashes(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise InvalidRequest(f"bridged message: {what} must be a list")
    return tuple(_int(h, what) for h in value)


def _decode_event(raw: Any) -> CacheEvent:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("bridged message: an event must be a non-empty list")
    kind = raw[0]
    if kind == _STORED and len(raw) == 11:
        _, tokens, hashes, parent, block_size, model, lora, group, group_kind, salt, extras = raw
        if not isinstance(tokens, bytes) or len(tokens) % 4:
            raise InvalidRequest("bridged message: token_ids must be little-endian uint32 bytes")
        return Stored(
            token_ids=tokens,
            engine_hashes=None if hashes is None else _hashes(hashes, "engine_hashes"),
            parent_engine_hash=_opt_int(parent, "parent_engine_hash"),
            block_size=_int(block_size, "block_size", 1 << 32),
            model=_str(model, "model"), lora=_str(lora, "lora"),
            group=_opt_int(group, "group"),
            group_kind=None if group_kind is None else _str(group_kind, "group_kind"),
            salt=_str(salt, "salt"),
            extra_hashes=None if extras is None else _hashes(extras, "extra_hashes"),
        )
    if kind == _REMOVED and len(raw) == 3:
        return Removed(_hashes(raw[1], "engine_hashes"), _opt_int(raw[2], "group"))
    if kind == _CLEARED and len(raw) == 1:
        return Cleared()
    raise InvalidRequest(f"bridged message: unknown event layout (kind {kind!r}, {len(raw)} fields)")


def message(calls: Iterable[bytes]) -> bytes:
    """One bus message holding ``calls`` (each an ``encode_*`` result), in call order."""
    calls = list(calls)
    return _ARRAY_HEADER.pack_array_header(len(calls)) + b"".join(calls)


def decode_bridged(data: bytes, max_events: int) -> list[EventBatch | Reset | Rejected]:
    """The calls of one bridged message, in order; ``InvalidRequest`` (and nothing applied) if
    any of them is not one."""
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise InvalidRequest(f"bridged message does not parse: {exc}") from None
    if not isinstance(msg, list) or not msg:
        raise InvalidRequest("bridged message: expected a non-empty list of calls")
    return [_decode_call(call, max_events) for call in msg]


def _decode_call(msg: Any, max_events: int) -> EventBatch | Reset | Rejected:
    if not isinstance(msg, list) or len(msg) < 3:
        raise InvalidRequest("bridged message: expected [op, worker_id, ...]")
    op, worker_id = msg[0], _str(msg[1], "worker_id")
    if not worker_id:
        raise InvalidRequest("bridged message without worker_id")
    if op == _OP_EVENTS and len(msg) == 4:
        events = msg[3]
        if not isinstance(events, list):
            raise InvalidRequest("bridged message: events must be a list")
        if len(events) > max_events:
            raise InvalidRequest(f"bridged batch of {len(events)} events exceeds max_batch_events={max_events}")
        return EventBatch(worker_id, _int(msg[2], "sequence"), tuple(_decode_event(e) for e in events))
    if op == _OP_RESET and len(msg) == 3 and isinstance(msg[2], bool):
        return Reset(worker_id, msg[2])
    if op == _OP_REJECTED and len(msg) == 4 and isinstance(msg[2], dict) and isinstance(msg[3], bool):
        counts = {_str(k, "reason"): _int(v, "count") for k, v in msg[2].items()}
        return Rejected(worker_id, counts, msg[3])
    raise InvalidRequest(f"bridged message: unknown operation {op!r}")


# ---- replica side ----------------------------------------------------------------------------
class BridgedEvents:
    """What a replica does with a bridged message: the call the ZMQ source made at the bridge,
    on this replica's router. The daemon passes the callbacks it gives its own ZMQ source."""

    def __init__(
        self,
        apply: Callable[[EventBatch], BatchOutcome],
        reset: Callable[[str, bool], object],
        rejected: Callable[[str, Mapping[str, int], bool], object],
        max_events: int,
    ) -> None:
        self._apply, self._reset, self._rejected = apply, reset, rejected
        self._max_events = max_events

    def __call__(self, data: bytes) -> BatchOutcome:
        """Make every call of the message, in order; the outcome sums theirs. A call the router
        refuses (its worker unknown here) does not stop the others, which concern their own
        batches; the first refusal is raised afterwards, so the bus counts and logs it."""
        total = BatchOutcome(applied=True, duplicate=True)
        refused: KVRouterError | None = None
        for call in decode_bridged(data, self._max_events):
            try:
                outcome = self._call(call)
            except KVRouterError as exc:
                refused = refused or exc
                continue
            total.duplicate = total.duplicate and outcome.duplicate
            total.gap += outcome.gap
            total.restarted = total.restarted or outcome.restarted
            total.lost_removal = total.lost_removal or outcome.lost_removal
            for reason, n in outcome.rejected.items():
                total.rejected[reason] = total.rejected.get(reason, 0) + n
        if refused is not None:
            raise refused
        return total

    def _call(self, call: EventBatch | Reset | Rejected) -> BatchOutcome:
        if isinstance(call, EventBatch):
            return self._apply(call)
        if isinstance(call, Reset):
            self._reset(call.worker_id, call.lost)
            return BatchOutcome(applied=True, gap=1 if call.lost else 0)
        self._rejected(call.worker_id, call.counts, call.lost_removal)
        return BatchOutcome(applied=True, rejected=call.counts, lost_removal=call.lost_removal)


# ---- bridge side -----------------------------------------------------------------------------
@dataclass
class BridgeStats:
    """What the bridge published; the ZMQ side's counts are ``BusBridge.source.stats()``."""

    published: int = 0  # messages JetStream acknowledged
    batches: int = 0  # of which event batches
    resets: int = 0
    lost_resets: int = 0  # resets telling replicas a worker lost events (the source's, and overflows)
    rejections: int = 0
    publish_retries: int = 0  # publishes retried after a timeout or a NATS outage
    overflow_dropped: int = 0  # batches dropped because max_pending calls were queued
    resubscribes: int = 0  # subscribers restarted after an overflow
    pending: int = 0
    connected: bool = False
    overflowed: set[str] = field(default_factory=set)


class BusBridge:
    """ZMQ subscribers whose output goes into the JetStream stream instead of a router."""

    def __init__(
        self,
        events: ZmqEventsConfig,
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
        publish_timeout_s: float = 5.0,
        max_part_blocks: int = MAX_PART_BLOCKS,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        if not events.bus.enabled:
            raise BusUnavailable("kvrouterd bridge needs events.bus (kind: nats, url: ...) to publish into")
        if max_pending < 2:
            raise InvalidRequest(f"bridge max_pending must be >= 2, got {max_pending}")
        self.bus: NatsBusConfig = events.bus
        self.max_pending = max_pending
        self.publish_timeout_s = publish_timeout_s
        self.stats = BridgeStats()
        self.run_id = uuid.uuid4().hex[:12]
        self.source = ZmqEventSource(events, apply=self._on_batch, reset=self._on_reset, rejected=self._on_rejected,
                                     max_part_blocks=max_part_blocks, block_size=block_size)
        #: blocks one message may carry: a replica applies a message in one turn of its loop
        self.max_message_blocks = max_part_blocks
        self.block_size = block_size
        self._queue: deque[tuple[str, str, bytes, int]] = deque()  # (worker, subject, body, blocks)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._n = 0
        self._nc: Any = None
        self._js: Any = None
        self._publisher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect to NATS and make sure the stream exists (``BusUnavailable`` if it cannot),
        then publish what the subscribers hand over."""

        async def disconnected() -> None:
            self.stats.connected = False

        async def reconnected() -> None:
            self.stats.connected = True
            log.warning("bridge reconnected to NATS", extra={"url": self.bus.url})

        self._nc = await connect(self.bus, disconnected_cb=disconnected, reconnected_cb=reconnected)
        self._js = self._nc.jetstream()
        try:
            await ensure_stream(self._js, self.bus)
        except Exception as exc:
            await self._nc.close()
            raise BusUnavailable(f"events.bus: JetStream stream {self.bus.stream!r} unavailable: {exc}") from None
        self.stats.connected = True
        self._publisher = asyncio.create_task(self._publish_loop(), name="kvrouterd-bridge-publish")
        log.info("bridging ZMQ KV events onto the bus", extra={"stream": self.bus.stream, "url": self.bus.url})

    def sync(self, workers: Iterable[_WorkerLike]) -> None:
        """Subscribe to every EVENTS-mode worker with a ``kv_events_endpoint`` (ZmqEventSource.sync)."""
        self.source.sync(workers)

    # -- the source's callbacks: queue in call order ----------------------------------------
    def _on_batch(self, batch: EventBatch) -> BatchOutcome:
        wid = batch.worker_id
        if wid in self.stats.overflowed:
            self.stats.overflow_dropped += 1
            return BatchOutcome(applied=True)
        if len(self._queue) >= self.max_pending:
            # NATS cannot keep up (or is away): stop queueing this worker, resync it later
            self.stats.overflow_dropped += 1
            self._lose(wid, f"bridge queue full ({self.max_pending} calls)")
            return BatchOutcome(applied=True)
        self.stats.batches += 1
        self._enqueue(wid, encode_batch(batch), batch_blocks(batch.events, self.block_size))
        return BatchOutcome(applied=True)

    def _lose(self, worker_id: str, why: str) -> None:
        """Drop the worker's calls until it is resubscribed, and tell the replicas its view is
        lost (that reset goes past max_pending: it must reach them)."""
        self.stats.overflowed.add(worker_id)
        self.stats.lost_resets += 1
        log.error("%s: worker's batches dropped until it is resynced", why, extra={"worker_id": worker_id})
        self._enqueue(worker_id, encode_reset(worker_id, True))

    def _on_reset(self, worker_id: str, lost: bool) -> None:
        if worker_id in self.stats.overflowed:
            return  # replicas already hold it lost; the resubscribe resets it again
        self.stats.resets += 1
        self.stats.lost_resets += lost
        self._enqueue(worker_id, encode_reset(worker_id, lost))

    def _on_rejected(self, worker_id: str, counts: Mapping[str, int], lost_removal: bool) -> None:
        if worker_id in self.stats.overflowed:
            return
        self.stats.rejections += 1
        self._enqueue(worker_id, encode_rejected(worker_id, counts, lost_removal))

    def _enqueue(self, worker_id: str, body: bytes, blocks: int = 0) -> None:
        self._queue.append((worker_id, worker_subject(self.bus.subject_prefix, worker_id), body, blocks))
        self.stats.pending = len(self._queue)
        self._idle.clear()
        self._wake.set()

    # -- publishing --------------------------------------------------------------------------
    async def _publish_loop(self) -> None:
        """Publish what is queued, oldest first. The calls queued for one worker go out
        together, one message per worker (a replica needs only each worker's calls in order:
        each call concerns its worker alone), each message until JetStream acknowledges it."""
        while True:
            if not self._queue:
                self._resubscribe_overflowed()
                if not self._queue:
                    self._idle.set()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
            for subject, body in self._take():
                await self._publish(subject, body)
            self.stats.pending = len(self._queue)
            if len(self._queue) <= self.max_pending // 2:
                self._resubscribe_overflowed()

    def _take(self) -> list[tuple[str, bytes]]:
        """The queue's head as one message per worker, each within the server's payload limit
        and, past its first call, ``max_message_blocks``: a replica applies a message in one
        turn of its loop, so the parts of a huge engine batch go out one a message, as the
        source made them (``events.parts``), while small batches still travel together."""
        limit = max(4096, int(getattr(self._nc, "max_payload", 1 << 20)) - 4096)  # room for headers
        groups: dict[str, tuple[str, list[bytes]]] = {}
        sizes: dict[str, int] = {}
        blocks: dict[str, int] = {}
        while self._queue and sum(len(calls) for _, calls in groups.values()) < MAX_CALLS_PER_ROUND:
            wid, subject, body, n = self._queue[0]
            if len(body) > limit:
                self._queue.popleft()
                self._lose(wid, f"a call of {len(body)} bytes exceeds the NATS server's max_payload")
                continue
            if sizes.get(wid, 0) + len(body) > limit or (wid in blocks and blocks[wid] + n > self.max_message_blocks):
                break  # this worker's message is full: the rest waits for the next round
            self._queue.popleft()
            groups.setdefault(wid, (subject, []))[1].append(body)
            sizes[wid] = sizes.get(wid, 0) + len(body)
            blocks[wid] = blocks.get(wid, 0) + n
        return [(subject, message(calls)) for subject, calls in groups.values()]

    async def _publish(self, subject: str, body: bytes) -> None:
        """Publish one message until JetStream acknowledges it; a retry keeps its message id,
        so the stream drops a copy it already stored."""
        from nats.js.errors import NoStreamResponseError

        msg_id = f"bridge.{self.run_id}.{self._n}"
        self._n += 1
        # any Exception: timeouts, a connection being re-established, no responders
        async for attempt in BRIDGE_PUBLISH_BACKOFF.retrying(Exception, before_sleep=self._publish_failed):
            with attempt:
                try:
                    await self._js.publish(subject, body, timeout=self.publish_timeout_s,
                                           headers={BRIDGE_HEADER: WIRE_VERSION, "Nats-Msg-Id": msg_id})
                except NoStreamResponseError:
                    # no stream takes the subject: NATS lost it (a server restarted without its
                    # store) and no replica has made it again yet; make it, and the retry sends
                    await ensure_stream(self._js, self.bus)
                    raise
        self.stats.published += 1

    def _publish_failed(self, state: tenacity.RetryCallState) -> None:
        self.stats.publish_retries += 1
        exc = state.outcome.exception() if state.outcome is not None else None
        log.warning("bridge publish failed (%s); retrying in %.2fs", exc or type(exc).__name__, state.upcoming_sleep)

    def _resubscribe_overflowed(self) -> None:
        """Start the overflowed workers' subscribers again: each resets its worker and
        rejoins the engine by replay, which makes it READY on the replicas again."""
        for wid in list(self.stats.overflowed):
            self.stats.overflowed.discard(wid)
            sub = self.source.subscribers.get(wid)
            if sub is not None:
                self.stats.resubscribes += 1
                log.info("resubscribing after a bridge overflow", extra={"worker_id": wid})
                self.source.add(sub.endpoint)

    async def drained(self, timeout: float | None = None) -> bool:
        """Whether everything queued so far was acknowledged within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self, timeout: float = 5.0) -> None:
        """Stop subscribing, publish what is queued (for at most ``timeout`` s), disconnect."""
        await self.source.close()
        if self._publisher is not None:
            if not await self.drained(timeout):
                log.warning("bridge closed with %d call(s) unpublished; replicas resync when it restarts",
                            len(self._queue))
            await stop_task(self._publisher)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            self._nc = None
            self._js = None
