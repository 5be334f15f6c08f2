"""Put one engine endpoint's KV-event batches in order: gaps replayed, restarts found, hand-off.

Each message is ``[topic, seq (8-byte big-endian), payload]``; ``engine_format`` decodes the
payload. ``EndpointSequencer`` takes them one at a time (``zmq_source`` receives them).

Sequencing is owned here, not by ``Router.apply``:

* The engine numbers batches +1 each and restarts at 0. We track the next expected number.
* A jump forward is a gap: we ask the engine's ROUTER replay endpoint with a DEALER
  (``[b"", start_seq]``), apply the replayed batches (``[b"", seq, payload]`` from
  vLLM <= 0.25, ``[b"", topic, seq, payload]`` from newer vLLM and SGLang: the last two frames
  are taken) until the end marker ``seq = 0xFF * 8``. Live batches already covered by the
  replay are dropped as duplicates.
* A replay that is unavailable (no endpoint, timeout) or too old (its first batch is later
  than the one we need) loses events for good: ``reset(worker, lost=True)`` clears the worker
  and marks it DEGRADED until the engine clears its cache or restarts. Counted and logged.
* A drop in the number is an engine restart: its cache is empty, so the next batch we hand
  over starts with ``Cleared`` (which also ends a DEGRADED state). If we missed the first
  batches of the new run we replay from 0.
* A restart can also hide behind a number that goes on (the connection dropped, and the new
  run reached or passed our number meanwhile): after a disconnect, the first batch at or past
  the expected number (in order or a gap) is checked against the engine's replay of our last
  batch first; another payload is another run, replayed from 0.
* Joining a running engine (first number > 0) replays from 0 when ``replay_on_join``;
  if the engine no longer buffers that far back, the worker is degraded as above.

The router sees each worker's batches numbered 0, 1, 2, ... by us after ``reset(worker,
lost=False)`` at start, so its own gap and restart checks never fire a second time.

A batch of more than ``max_part_blocks`` blocks (a step that prefilled a long prompt at once:
a 1M-token prompt is one ``BlockStored`` of 62.5k blocks) is handed over as consecutive router
batches, its parts (``events.parts``), with the loop free for routing between them; the
engine's batch is still sequenced, digested and replayed as one. A worker removed or reset
between two parts gets none of the rest (``SubscriberStats.parts_abandoned``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import xxhash
import zmq
import zmq.asyncio

from ..clock import Clock
from ..errors import ConfigError, KVRouterError
from ..protocols import BatchOutcome, CacheEvent, Cleared, EventBatch
from .endpoints import ZmqEndpoint
from .engine_event import MalformedPayload, TierEvent
from .engine_format import DecodedBatch, decode_payload, peek_timestamp
from .parts import DEFAULT_BLOCK_SIZE, MAX_PART_BLOCKS, batch_blocks, split_events
from .zmq_config import ZmqEventsConfig

__all__ = ["END_SEQ", "ApplyFn", "EndpointSequencer", "RejectedFn", "ResetFn", "SubscriberStats"]

log = logging.getLogger("kvrouterd.events.zmq")


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


#: the replay end marker's sequence frame
END_SEQ = b"\xff" * 8

ApplyFn = Callable[[EventBatch], BatchOutcome]
ResetFn = Callable[[str, bool], object]
#: (worker id, events rejected by reason, whether one may have been a removal)
RejectedFn = Callable[[str, Mapping[str, int], bool], object]

#: Least seconds between two rebuilds of a worker's view by replay after a lost removal,
#: so an engine that keeps sending an undecodable removal cannot keep us replaying.
RESYNC_MIN_INTERVAL_S = 30.0


@dataclass
class SubscriberStats:
    """What an endpoint's subscriber has seen; ``kvrouterd status`` and metrics read it."""

    batches_received: int = 0
    batches_applied: int = 0
    malformed: int = 0
    rejected: int = 0  # decoded fine, but the router refused it (e.g. block size mismatch)
    duplicates: int = 0
    gaps: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    desyncs: int = 0  # events lost beyond replay: worker cleared and degraded
    restarts: int = 0
    skipped_events: int = 0
    rejected_events: int = 0  # undecodable events or events the router could not apply
    parts: int = 0  # router batches applied as parts of longer engine batches (events.parts)
    #: engine batches whose later parts were not applied: the worker was removed or reset, or
    #: the subscriber stopped, between two parts
    parts_abandoned: int = 0
    resyncs: int = 0  # views rebuilt by replay from 0 after a lost removal
    run_checks: int = 0  # replays asked to tell a restart the sequence hid (after a disconnect)
    subscriber_restarts: int = 0  # the subscriber task died and was started again
    dp_rank_mismatch: int = 0
    reconnects: int = 0
    silent: bool = False
    last_sequence: int = -1
    last_batch_at: float | None = None
    #: non-GPU tier -> engine hashes held there (only with other_media="track")
    tier_blocks: dict[str, set[int]] = field(default_factory=dict)


class EndpointSequencer:
    """Sequencing, replay and hand-off to the router for one engine endpoint (one DP rank).

    ``handle_frames`` takes each live message; ``zmq_source.EndpointSubscriber`` adds the SUB
    socket that receives them. ``ctx`` makes the DEALER sockets replays are asked on."""

    def __init__(
        self,
        endpoint: ZmqEndpoint,
        config: ZmqEventsConfig,
        apply: ApplyFn,
        reset: ResetFn,
        ctx: zmq.asyncio.Context,
        clock: Clock,
        rejected: RejectedFn | None = None,
        *,
        max_part_blocks: int = MAX_PART_BLOCKS,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        endpoint.validate()
        if max_part_blocks < 1 or block_size < 1:
            raise ConfigError(f"max_part_blocks and block_size must be >= 1, got {max_part_blocks}, {block_size}")
        self.endpoint = endpoint
        #: an engine batch of more blocks is applied in parts of at most this many (events.parts)
        self.max_part_blocks = max_part_blocks
        #: the router's block size: where a chain of other-sized pages may be cut
        self.block_size = block_size
        self.config = config
        self._apply_fn = apply
        self._reset_fn = reset
        self._rejected_fn = rejected
        self._lora_names = config.lora_names
        self._ctx = ctx
        self._clock = clock
        self.stats = SubscriberStats()
        self._expected: int | None = None  # next engine sequence; None before first contact
        self._router_seq = 0  # numbers we hand to the router, 0.. after each reset
        self._dup_lo = self._dup_hi = 0  # live batches in [lo, hi) were already replayed
        self._pending_clear = False
        self._started = False
        self._needs_resync = False
        self._rebuilding = False
        self._last_resync_at: float | None = None
        #: (sequence, xxh3 of the payload) of the last batch accepted, and its timestamp:
        #: what a replay is compared with to tell an engine restart the sequence hides
        self._last_digest: tuple[int, int] | None = None
        self._last_ts: float | None = None
        #: the connection dropped (or the clock went back): check the run before going on
        self._verify_pending = False

    @property
    def worker_id(self) -> str:
        return self.endpoint.worker_id

    # ---- sequencing ---------------------------------------------------------------------
    def _start_session(self) -> None:
        if not self._started:
            self._reset(lost=False)
            # the first batch we hand over rebuilds the view from empty: READY again if a
            # failed subscriber before us left the worker DEGRADED
            self._pending_clear = True
            self._started = True

    async def handle_frames(self, frames: Sequence[bytes]) -> None:
        """One live message: ``[topic, seq, payload]`` (only the last two frames are read)."""
        self._start_session()
        self.stats.batches_received += 1
        if len(frames) < 2 or len(frames[-2]) != 8:
            self.stats.malformed += 1
            log.warning("malformed KV-event message skipped (%d frames)", len(frames), extra={"worker_id": self.worker_id})
            return
        seq = int.from_bytes(frames[-2], "big")
        payload = frames[-1]
        expected = self._expected
        if expected is None:
            if seq == 0 or not self.config.replay_on_join:
                await self._accept_all(seq, payload)
            else:
                await self._recover(0, seq, payload, why="join")
        elif seq >= expected and await self._restarted_unseen(payload):
            # checked on the gap path too: a new run that published more batches than we
            # expected while we were away looks like a gap, and replaying the missing range
            # of the new run onto the old view would keep the old run's blocks
            self.stats.restarts += 1
            log.warning("engine restart detected by replay although the sequence went on (%d after %d)", seq,
                        expected - 1, extra={"worker_id": self.worker_id})
            self._pending_clear = True
            self._dup_lo = self._dup_hi = 0
            self._tier_clear()
            await self._recover(0, seq, payload, why="unseen restart")
        elif seq == expected:
            if (rest := self._accept(seq, payload)) is not None:
                await self._apply_rest(rest)
        elif seq > expected:
            self.stats.gaps += 1
            log.warning(
                "KV-event gap: expected %d, got %d; replaying", expected, seq, extra={"worker_id": self.worker_id}
            )
            await self._recover(expected, seq, payload, why="gap")
        elif self._dup_lo <= seq < self._dup_hi:
            self.stats.duplicates += 1
        else:
            self.stats.restarts += 1
            log.warning("engine restart detected (sequence %d after %d)", seq, expected - 1,
                        extra={"worker_id": self.worker_id})
            self._pending_clear = True
            self._dup_lo = self._dup_hi = 0
            self._tier_clear()
            if seq == 0:
                await self._accept_all(seq, payload)
            else:
                await self._recover(0, seq, payload, why="restart")
        if self._needs_resync:
            await self._resync()

    async def _restarted_unseen(self, payload: bytes) -> bool:
        """Whether the engine restarted since our last batch although its sequence went on
        (to the number we expect, or past it: a gap).

        Checked only when something on the wire says it may have: the connection dropped
        since that batch, or this batch's timestamp is earlier than it. The engine's replay
        of our last sequence number is compared with what we applied under it: another
        payload means another run. Without a replay endpoint, or once the engine no longer
        buffers that batch, a restart that published at least as many batches as we had seen
        stays undetectable (docs/engine-events.md)."""
        ts = peek_timestamp(payload)
        went_back = ts is not None and self._last_ts is not None and ts < self._last_ts
        if not (self._verify_pending or went_back) or self._last_digest is None:
            return False
        self._verify_pending = False
        self.stats.run_checks += 1
        last_seq, last_digest = self._last_digest
        replayed = await self._replay(last_seq, limit=1)
        if not replayed or replayed[0][0] != last_seq:
            if went_back:
                log.warning("batch timestamp went back but the replay cannot confirm a restart",
                            extra={"worker_id": self.worker_id})
            return False
        return _digest(replayed[0][1]) != last_digest

    async def _resync(self) -> None:
        """Rebuild the worker's view by replaying from 0, after an event that may have been a
        removal could not be used. Until it succeeds the worker stays DEGRADED (the router
        marked it when the event was counted); a ``Cleared`` or an engine restart ends that too.
        The rebuild reads the replayed batches again, so events it still cannot use are
        counted again and keep the worker DEGRADED."""
        self._needs_resync = False
        now = self._clock.now()
        if self._last_resync_at is not None and now - self._last_resync_at < RESYNC_MIN_INTERVAL_S:
            return
        self._last_resync_at = now
        upto = self._expected or 0
        replayed = await self._replay(0)
        if not replayed or [rseq for rseq, _ in replayed if rseq < upto] != list(range(upto)):
            log.warning("cannot rebuild the view by replay (the engine no longer buffers from 0); "
                        "worker stays degraded until it clears its cache or restarts", extra={"worker_id": self.worker_id})
            return
        self._reset(lost=False)
        self._pending_clear = True  # the rebuilt view starts empty and READY again...
        self._handoff(DecodedBatch(0.0, None, ()))  # ...now, so a batch it still cannot use degrades it anew
        self._rebuilding = True
        try:
            for rseq, rpayload in replayed:
                if rseq >= upto:
                    break
                await self._accept_all(rseq, rpayload)
        finally:
            self._rebuilding = False
        self.stats.resyncs += 1
        log.info("view rebuilt by replaying %d batch(es) after a lost removal", upto, extra={"worker_id": self.worker_id})

    async def _recover(self, start: int, seq: int, payload: bytes, why: str) -> None:
        """Replay [start, ...) from the engine, then go on after the message ``seq`` that
        revealed the gap. If the replay cannot bridge [start, seq), those events are lost."""
        replayed = await self._replay(start)
        nxt = start
        if replayed and replayed[0][0] == start:
            for rseq, rpayload in replayed:
                if rseq != nxt:
                    break  # a hole inside the replay: stop at the last contiguous batch
                await self._accept_all(rseq, rpayload)
                nxt = rseq + 1
        if nxt > seq:
            self.stats.replays_ok += 1
            # live messages after ``seq`` queued while we replayed; the replay already had them
            self._dup_lo, self._dup_hi = seq + 1, nxt
            log.info("replayed %d batch(es) from %d (%s)", nxt - start, start, why, extra={"worker_id": self.worker_id})
            return
        if nxt == seq:
            self.stats.replays_ok += 1
            await self._accept_all(seq, payload)
            return
        self.stats.replays_failed += 1
        self.stats.desyncs += 1
        reason = "unavailable" if replayed is None else "too old" if nxt == start else "incomplete"
        log.warning(
            "replay from %d %s (%s): worker cleared and degraded until the engine resyncs", start, reason, why,
            extra={"worker_id": self.worker_id},
        )
        self._reset(lost=True)
        await self._accept_all(seq, payload)

    async def _accept_all(self, seq: int, payload: bytes) -> None:
        """``_accept``, then the batch's later parts if it has any (off the common path)."""
        if (rest := self._accept(seq, payload)) is not None:
            await self._apply_rest(rest)

    def _accept(self, seq: int, payload: bytes) -> Iterator[tuple[CacheEvent, ...]] | None:
        """Decode one in-order batch and hand it to the router. A batch of more than
        ``max_part_blocks`` blocks is applied in its first part here; the later parts are
        returned, for ``_apply_rest`` (the batch is sequenced and digested as one either way)."""
        self._expected = seq + 1
        self.stats.last_sequence = seq
        self.stats.last_batch_at = self._clock.now()
        self._last_digest = (seq, _digest(payload))
        try:
            decoded = decode_payload(payload, self.endpoint.model, self._lora_names)
        except MalformedPayload as exc:
            self.stats.malformed += 1
            log.warning("malformed KV-event batch %d skipped: %s", seq, exc, extra={"worker_id": self.worker_id})
            self._count_rejected({"malformed_batch": 1}, lost_removal=True)  # a whole step: removals too
            return None
        return self._handoff(decoded)

    def _count_rejected(self, rejected: Mapping[str, int], lost_removal: bool) -> None:
        self.stats.rejected_events += sum(rejected.values())
        if self._rejected_fn is not None:
            try:
                self._rejected_fn(self.worker_id, rejected, lost_removal)
            except KVRouterError as exc:
                log.warning("cannot count rejected events: %s", exc, extra={"worker_id": self.worker_id})
        if lost_removal and not self._rebuilding:
            self._needs_resync = True

    def _handoff(self, decoded: DecodedBatch) -> Iterator[tuple[CacheEvent, ...]] | None:
        stats = self.stats
        if decoded.timestamp:
            self._last_ts = decoded.timestamp
        stats.skipped_events += decoded.skipped
        noted: dict[str, int] = dict(decoded.rejected)
        if decoded.skipped:
            noted["unknown_type"] = decoded.skipped
        if decoded.dp_rank is not None and decoded.dp_rank != self.endpoint.dp_rank:
            stats.dp_rank_mismatch += 1
            noted["dp_rank_mismatch"] = 1
        if noted:
            self._count_rejected(noted, decoded.lost_removal)
        if decoded.tier_events:
            self._track_tiers(decoded.tier_events)
        events: tuple[CacheEvent, ...] = decoded.events
        if self._pending_clear:
            events = (Cleared(), *events)
        if not events:
            return None
        parts: Iterator[tuple[CacheEvent, ...]] | None = None
        if len(events) > self.max_part_blocks or batch_blocks(events, self.block_size) > self.max_part_blocks:
            parts = split_events(events, self.max_part_blocks, self.block_size)
            events = next(parts)
        try:
            outcome = self._apply_fn(EventBatch(self.worker_id, self._router_seq, events))
        except KVRouterError as exc:
            stats.rejected += 1
            log.warning("KV-event batch rejected by the router: %s", exc, extra={"worker_id": self.worker_id})
            return None
        stats.rejected_events += sum(outcome.rejected.values())
        self._router_seq += 1
        self._pending_clear = False
        stats.batches_applied += 1
        if parts is not None:
            stats.parts += 1
        return parts

    async def _apply_rest(self, parts: Iterator[tuple[CacheEvent, ...]]) -> None:
        """The later parts of an engine batch, each as the next router batch, the loop free
        for other work before each. The worker removed or reset meanwhile (the router refuses
        the part, or finds it out of sequence) or the subscriber stopped: the remaining parts
        are dropped, counted and logged once (a reset clears or rebuilds the view anyway)."""
        stats = self.stats
        for events in parts:
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                stats.parts_abandoned += 1
                log.info("subscriber stopped between the parts of a KV-event batch; the rest is not applied",
                         extra={"worker_id": self.worker_id})
                raise
            try:
                outcome = self._apply_fn(EventBatch(self.worker_id, self._router_seq, events))
            except KVRouterError as exc:
                why = str(exc)
            else:
                stats.rejected_events += sum(outcome.rejected.values())
                self._router_seq += 1
                stats.parts += 1
                if not (outcome.duplicate or outcome.gap or outcome.restarted):
                    continue
                why = "the router's sequence for the worker changed (it was reset or registered again)"
            stats.parts_abandoned += 1
            log.warning("the rest of a KV-event batch applied in parts is dropped: %s", why,
                        extra={"worker_id": self.worker_id})
            return

    def _reset(self, lost: bool) -> None:
        try:
            self._reset_fn(self.worker_id, lost)
        except KVRouterError as exc:
            log.warning("cannot reset worker state: %s", exc, extra={"worker_id": self.worker_id})
        self._router_seq = 0
        self._pending_clear = False
        self._dup_lo = self._dup_hi = 0
        self._tier_clear()

    # ---- other tiers ----------------------------------------------------------------------
    def _track_tiers(self, events: Sequence[TierEvent]) -> None:
        if self.config.other_media != "track":
            return
        tiers = self.stats.tier_blocks
        for ev in events:
            held = tiers.setdefault(ev.medium, set())
            if ev.kind == "stored":
                held.update(ev.engine_hashes)
            elif ev.kind == "removed":
                held.difference_update(ev.engine_hashes)
            else:
                held.clear()

    def _tier_clear(self) -> None:
        for held in self.stats.tier_blocks.values():
            held.clear()

    # ---- replay ---------------------------------------------------------------------------
    async def _replay(self, start: int, limit: int | None = None) -> list[tuple[int, bytes]] | None:
        """Batches the engine still buffers from ``start`` on (at most ``limit``: the rest
        of the reply is left unread on a socket we close); None if replay is unavailable."""
        address = self.endpoint.replay_address
        if not address:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(address)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while len(out) < (limit or self.config.replay_max_batches):
                frames = await asyncio.wait_for(sock.recv_multipart(), self.config.replay_timeout_s)
                if len(frames) < 2 or len(frames[-2]) != 8:
                    self.stats.malformed += 1
                    continue
                if frames[-2] == END_SEQ:
                    return out
                out.append((int.from_bytes(frames[-2], "big"), frames[-1]))
            return out
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("replay request to %s failed: %s", address, exc or "timeout", extra={"worker_id": self.worker_id})
            # batches received before the failure are still usable if they start where asked
            return out or None
        finally:
            sock.close(linger=0)
